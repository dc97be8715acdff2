"""Helpers shared by the tncomp tests: einsum references and random operands for a Network."""

from __future__ import annotations

import string
from collections.abc import Sequence

import torch

import tncomp
from tncomp import Network
from tncomp.compiler.ir import bind_dims as bind  # tests say bind(net, batch)

F64 = torch.float64


def einsum_eq(net: Network) -> str:
    """The torch.einsum equation of ``net`` (index names mapped to single letters)."""
    letters: dict[str, str] = {}
    pool = iter(string.ascii_letters)
    for spec in (*net.operands, net.output):
        for index in spec.indices:
            if index not in letters:
                letters[index] = next(pool)
    lhs = ",".join("".join(letters[i] for i in t.indices) for t in net.operands)
    return lhs + "->" + "".join(letters[i] for i in net.output.indices)


def shapes(net: Network, batch: int) -> list[tuple[int, ...]]:
    sizes = bind(net, batch)
    return [tuple(sizes[i] for i in t.indices) for t in net.operands]


def operands(net: Network, batch: int = 1, *, seed: int = 0, dtype=F64,
             requires_grad: bool | Sequence[bool] = False) -> list[torch.Tensor]:
    """Fresh random operands of ``net`` at ``batch`` (leaves, optionally requiring grad)."""
    gen = torch.Generator().manual_seed(seed)
    flags = ([requires_grad] * len(net.operands) if isinstance(requires_grad, bool)
             else list(requires_grad))
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_(g)
            for s, g in zip(shapes(net, batch), flags, strict=True)]


def reference(net: Network, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.einsum(einsum_eq(net), *tensors)


def batches_around(breakpoints: Sequence[int], limit: int,
                   extra: Sequence[int] = (1, 2)) -> list[int]:
    """Batch sizes on both sides of every breakpoint (and ``extra``), up to ``limit``."""
    values = set(extra)
    for bp in breakpoints:
        values.update({bp - 1, bp, bp + 1})
    return sorted(v for v in values if 1 <= v <= limit)


def compile_net(net: Network, **options) -> tncomp.CompiledNetwork:
    options.setdefault("disk_cache", False)
    return tncomp.compile(net, **options)
