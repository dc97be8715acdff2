"""Checks every format's test runs: its compiled network, its dense reconstruction and
``torch.einsum`` of its equation agree on random float64 inputs, forward and backward."""

from __future__ import annotations

import torch
from torch import Tensor

import tncomp
from comera.formats.layout import Layout
from comera.formats.registry import Format


def random_cores(layout: Layout, gen: torch.Generator) -> list[Tensor]:
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in
            layout.core_shapes]


def check_network(fmt: Format, layout: Layout, gen: torch.Generator, batch: int = 3) -> None:
    """compiled(x, *cores) == x @ layout.dense(cores) == einsum(layout.equation()), and the
    compiled backward passes gradcheck."""
    cores = random_cores(layout, gen)
    x = torch.randn(batch, *layout.in_modes, generator=gen, dtype=torch.float64)
    compiled = tncomp.compile(fmt.network(layout), disk_cache=False)
    y = compiled(x, *cores)
    assert tuple(y.shape) == (batch, *layout.out_modes)
    dense = x.reshape(batch, -1) @ layout.dense(cores)
    torch.testing.assert_close(y.reshape(batch, -1), dense, rtol=1e-12, atol=1e-12)
    by_einsum = torch.einsum(layout.equation(), x, *cores)
    torch.testing.assert_close(y, by_einsum, rtol=1e-12, atol=1e-12)
    inputs = [t.clone().requires_grad_(True) for t in (x, *cores)]
    assert torch.autograd.gradcheck(lambda *ts: compiled(*ts), inputs)
