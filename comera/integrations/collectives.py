"""Averaging tensors over the data-parallel workers: the one all-reduce of gradients.

Plain data parallelism (:mod:`comera.experiments.distributed`) averages every gradient with it;
FSDP2 (:mod:`comera.integrations.fsdp`) the replicated ones, which FSDP does not reduce.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["average_over_workers_"]


def average_over_workers_(tensors: Iterable[Tensor]) -> None:
    """Replace each of ``tensors`` by its mean over the workers, in place: one flat
    ``all_reduce`` per dtype. Every worker passes the same tensors in the same order. Nothing
    happens without an initialised process group of two or more workers."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = _flatten_dense_tensors(group)  # (sum of numels,)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= dist.get_world_size()
        for t, averaged in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
            t.copy_(averaged)
