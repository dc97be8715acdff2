"""Checks every format's tests run: its compiled network against einsum, forward and backward.

A format is right when ``tncomp.compile(fmt.network(layout))`` computes ``x @ layout.dense(cores)``
and ``torch.einsum(layout.equation(), x, *cores)``, with gradients that pass ``gradcheck`` and
``gradgradcheck`` and match autograd through einsum, all in float64.
"""

from __future__ import annotations

import opt_einsum
import torch

import tncomp
from comera.formats.layout import Layout
from comera.formats.registry import Format
from tests.helpers.tn import einsum_eq
from tncomp.compiler.ir import bind_dims

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-11}


def random_cores(layout: Layout, seed: int = 0) -> list[torch.Tensor]:
    """Fresh float64 cores of ``layout``'s shapes."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=F64) for s in layout.core_shapes]


def check_compiled_matches_einsum(fmt: Format, layout: Layout, batch: int = 3) -> None:
    """Forward and first gradients of the compiled network equal the dense product and einsum."""
    compiled = tncomp.compile(fmt.network(layout), disk_cache=False)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(batch, *layout.in_modes, generator=gen, dtype=F64)
    cores = random_cores(layout, seed=8)
    ours = [t.clone().requires_grad_() for t in (x, *cores)]
    refs = [t.clone().requires_grad_() for t in (x, *cores)]
    y = compiled(*ours)
    assert y.shape == (batch, *layout.out_modes)
    dense = x.reshape(batch, -1) @ layout.dense(cores)
    torch.testing.assert_close(y.reshape(batch, -1), dense, **TOL)
    y_ref = torch.einsum(layout.equation(), *refs)
    torch.testing.assert_close(y, y_ref, **TOL)
    dy = torch.randn(y.shape, generator=gen, dtype=F64)
    grads = torch.autograd.grad(y, ours, dy)
    grads_ref = torch.autograd.grad(y_ref, refs, dy)
    for g, r in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, r, **TOL)


def check_gradients(fmt: Format, layout: Layout, batch: int = 2) -> None:
    """``gradcheck`` and ``gradgradcheck`` of the compiled network (use tiny layouts)."""
    compiled = tncomp.compile(fmt.network(layout), disk_cache=False)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(batch, *layout.in_modes, generator=gen, dtype=F64, requires_grad=True)
    cores = [c.requires_grad_() for c in random_cores(layout, seed=4)]
    assert torch.autograd.gradcheck(compiled, (x, *cores), eps=1e-6, atol=1e-7, rtol=1e-6)
    assert torch.autograd.gradgradcheck(compiled, (x, *cores), eps=1e-6, atol=1e-7, rtol=1e-6)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def plan_flops_over_optimal(fmt: Format, layout: Layout, batch: int) -> float:
    """The forward FLOPs of tncomp's plan over opt_einsum's fewest (its exact dynamic
    programming search), at ``batch``."""
    net = fmt.network(layout)
    sizes = bind_dims(net, batch)
    shapes = [tuple(sizes[i] for i in t.indices) for t in net.operands]
    _, info = opt_einsum.contract_path(einsum_eq(net), *shapes, shapes=True, optimize="dp")
    plan = tncomp.compile(net, disk_cache=False).plan_for(sizes, (True,) * len(net.operands))
    return plan.forward_flops / float(info.opt_cost)
