"""Read many small device values back to the host in one transfer per device.

A training step's bookkeeping asks questions of every gate and gradient (is any entry pruned,
how many are alive, is every gradient finite). Asked one tensor at a time, each answer is a
device-to-host copy: on a GPU a synchronisation per gate, which made CoMERA's eager step on an
H200 wait hundreds of times a step (docs/gpu.md). Here each question is asked of all tensors at
once and read back with one copy per device."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from itertools import groupby

import torch
from torch import Tensor


def _per_device(values: Sequence[Tensor]) -> list:
    """``values`` (0-d tensors) as Python numbers in order, one host copy per device (stacked:
    no reshape per value, which :func:`read_lists` would need)."""
    out: list = [None] * len(values)
    order = sorted(range(len(values)), key=lambda i: str(values[i].device))
    for _, group in groupby(order, key=lambda i: str(values[i].device)):
        idx = list(group)
        for i, v in zip(idx, torch.stack([values[i] for i in idx]).tolist(), strict=True):
            out[i] = v
    return out


def any_true(masks: Sequence[Tensor]) -> list[bool]:
    """Per bool tensor of ``masks``, whether any entry is set."""
    return [bool(x) for x in _per_device([m.any() for m in masks])] if masks else []


def count_true(masks: Sequence[Tensor]) -> list[int]:
    """Per bool tensor of ``masks``, how many entries are set."""
    return [int(x) for x in _per_device([m.sum() for m in masks])] if masks else []


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """Whether every entry of every tensor is finite (no NaN, no infinity): one fused check
    per device and dtype (the kernel ``GradScaler`` checks gradients with, at scale 1, which
    leaves the values as they are), one read per device. Sparse tensors are checked by their
    values."""
    if any(type(t) not in (Tensor, torch.nn.Parameter) for t in tensors):
        # a tensor subclass (a DTensor shard under FSDP2, say) asked the plain way, each read
        return all(bool(torch.isfinite(t).all()) for t in tensors)
    dense = [t.coalesce().values() if t.is_sparse else t for t in tensors]
    flags = []
    key = lambda t: (str(t.device), str(t.dtype))  # noqa: E731
    for (_, _), group in groupby(sorted(dense, key=key), key=key):
        ts = list(group)
        if not ts[0].is_floating_point():
            continue  # integer tensors are always finite
        if any(t.requires_grad for t in ts):  # in a graph (create_graph): leave them untouched
            flags.append(torch.stack([torch.isfinite(t.detach()).all() for t in ts]).all())
            continue
        found = torch.zeros(1, dtype=torch.float32, device=ts[0].device)
        one = torch.ones(1, dtype=torch.float32, device=ts[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(ts, found, one)
        flags.append(found[0] == 0)
    return all(_per_device(flags)) if flags else True


def read_lists(tensors: Sequence[Tensor]) -> list[list[float]]:
    """Each 1-d tensor of ``tensors`` as a list of Python numbers (exactly its values, in the
    tensors' promoted dtype: bools stay bools), one host copy per device."""
    out: list = [None] * len(tensors)
    order = sorted(range(len(tensors)), key=lambda i: str(tensors[i].device))
    for _, group in groupby(order, key=lambda i: str(tensors[i].device)):
        idx = list(group)
        dtype = functools.reduce(torch.promote_types, (tensors[i].dtype for i in idx))
        flat = torch.cat([tensors[i].reshape(-1).to(dtype) for i in idx]).tolist()
        start = 0
        for i in idx:
            out[i] = flat[start:start + tensors[i].numel()]
            start += tensors[i].numel()
    return out
