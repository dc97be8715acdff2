"""Gradients of compiled networks: gradcheck at tiny sizes, einsum's autograd at real sizes.

tncomp runs its own planned backward pass (the reversed tree), not torch autograd through the
forward steps, so every gradient is checked against an independent reference.
"""

from __future__ import annotations

import pytest
import torch

import tncomp
from tests.helpers.tn import (
    F64,
    batches_around,
    bind,
    compile_net,
    einsum_eq,
    operands,
    reference,
)

TOL = {"rtol": 1e-9, "atol": 1e-10}

GRADCHECK_NETS = {
    "tt_d1": lambda: tncomp.tt_linear([3], [2], 2),
    "tt_d2": lambda: tncomp.tt_linear([2, 3], [3, 2], [2, 1, 2]),
    "tt_d3": lambda: tncomp.tt_linear([2, 1, 2], [2, 2, 1], 2),
    "ttm_d2": lambda: tncomp.ttm_linear([2, 3], [3, 2], 2),
    "embedding_d2": lambda: tncomp.ttm_embedding([2, 3], [3, 2], 2),
    "eq_hyperedge": lambda: tncomp.from_eq("bij,bjk->bik", ("B", 2, 3), ("B", 3, 2)),
    "eq_hyper_three": lambda: tncomp.from_eq("bi,bj,bk->ik", ("B", 2), ("B", 3), ("B", 2)),
    "eq_summed_in_operand": lambda: tncomp.from_eq("ijk,kl->il", (2, 3, 2), (2, 3)),
    "eq_single_operand": lambda: tncomp.from_eq("ijk->ki", (2, 3, 2)),
    "eq_full_reduction": lambda: tncomp.from_eq("ij,jk,ki->", (2, 3), (3, 2), (2, 2)),
}


@pytest.mark.parametrize("name", sorted(GRADCHECK_NETS))
def test_gradcheck(name):
    net = GRADCHECK_NETS[name]()
    f = compile_net(net)
    for b in (1, 3):
        ts = operands(net, b, seed=b, requires_grad=True)
        assert torch.autograd.gradcheck(f, tuple(ts), eps=1e-6, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("optimize", ["auto", "search", "flops"])
def test_gradcheck_presets(optimize):
    net = tncomp.tt_linear([2, 3], [3, 2], 2)
    f = compile_net(net, optimize=optimize)
    ts = operands(net, 2, seed=7, requires_grad=True)
    assert torch.autograd.gradcheck(f, tuple(ts), eps=1e-6, atol=1e-7, rtol=1e-6)


def _grads_vs_einsum(net, f, b, seed, requires=True):
    ts = operands(net, b, seed=seed, requires_grad=requires)
    refs = [t.detach().clone().requires_grad_(t.requires_grad) for t in ts]
    y = f(*ts)
    ry = reference(net, refs)
    torch.testing.assert_close(y, ry, **TOL)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=F64)
    wanted = [k for k, t in enumerate(ts) if t.requires_grad]
    got = torch.autograd.grad(y, [ts[k] for k in wanted], dy)
    want = torch.autograd.grad(ry, [refs[k] for k in wanted], dy)
    for k, g, w in zip(wanted, got, want, strict=True):
        assert g.shape == ts[k].shape
        torch.testing.assert_close(g, w, **TOL, msg=lambda m, k=k: f"operand {k}: {m}")


@pytest.mark.parametrize("batch", [1, 64])
def test_tt_768_matches_einsum_autograd(batch):
    net = tncomp.tt_linear([12, 8, 8], [8, 8, 12], 8)
    _grads_vs_einsum(net, compile_net(net), batch, seed=batch)


@pytest.mark.parametrize("kind", ["tt", "ttm"])
def test_gradients_across_regime_breakpoints(kind):
    build = tncomp.tt_linear if kind == "tt" else tncomp.ttm_linear
    net = build([3, 5, 2], [2, 7, 3], 3)
    f = compile_net(net)
    table = f.regimes((True,) * len(net.operands), itemsize=8)  # the table float64 calls use
    batches = batches_around(table.breakpoints, 400, extra=(1, 2, 50))
    trees = set()
    for b in batches:
        _grads_vs_einsum(net, f, b, seed=b)
        trees.add(table.tree_for(b))
    if any(bp <= 400 for bp in table.breakpoints):
        assert len(trees) >= 2


@pytest.mark.parametrize("optimize", ["search", "flops"])
def test_tt_768_presets_match_einsum_autograd(optimize):
    net = tncomp.tt_linear([12, 8, 8], [8, 8, 12], 8)
    _grads_vs_einsum(net, compile_net(net, optimize=optimize), 64, seed=11)


def test_ttm_and_embedding_match_einsum_autograd():
    net = tncomp.ttm_linear([4, 6, 8], [8, 6, 4], 6)
    _grads_vs_einsum(net, compile_net(net), 48, seed=3)
    emb = tncomp.ttm_embedding([10, 10, 10], [4, 8, 4], 8)
    _grads_vs_einsum(emb, compile_net(emb), 96, seed=4)


def test_embedding_grads_flow_through_the_gather():
    net = tncomp.ttm_embedding([4, 5], [3, 2], 3)
    gen = torch.Generator().manual_seed(9)
    shapes = [(1, 4, 3, 3), (3, 5, 2, 1)]
    cores = [torch.randn(s, generator=gen, dtype=F64, requires_grad=True) for s in shapes]
    ref_cores = [c.detach().clone().requires_grad_() for c in cores]
    ids = [torch.tensor([0, 3, 3, 1, 2]), torch.tensor([4, 0, 4, 2, 1])]

    def slices(cs):
        return [c.index_select(1, i).movedim(1, 0) for c, i in zip(cs, ids, strict=True)]

    y = compile_net(net)(*slices(cores))
    ry = reference(net, slices(ref_cores))
    dy = torch.randn(y.shape, generator=gen, dtype=F64)
    (y * dy).sum().backward()
    (ry * dy).sum().backward()
    for c, r in zip(cores, ref_cores, strict=True):
        torch.testing.assert_close(c.grad, r.grad, **TOL)


def test_inner_product_identity_at_a_larger_size():
    """<J t, c> = <t, J^T c>: the planned backward is the adjoint of the forward's derivative.

    The network is multilinear, so J t = sum_k f(p_1, .., t_k, .., p_n) exactly.
    """
    net = tncomp.tt_linear([12, 8, 8], [12, 16, 16], 16)
    f = compile_net(net)
    p = operands(net, 96, seed=21, requires_grad=True)
    t = operands(net, 96, seed=22)
    y = f(*p)
    c = torch.randn(y.shape, generator=torch.Generator().manual_seed(23), dtype=F64)
    grads = torch.autograd.grad(y, p, c)
    with torch.no_grad():
        frozen = [q.detach() for q in p]
        jt = sum(f(*frozen[:k], t[k], *frozen[k + 1:]) for k in range(len(p)))
    lhs = torch.vdot(jt.flatten(), c.flatten())
    rhs = sum(torch.vdot(tk.flatten(), g.flatten()) for tk, g in zip(t, grads, strict=True))
    torch.testing.assert_close(lhs, rhs, rtol=1e-10, atol=1e-8)
    # and J t itself is what einsum's multilinear expansion gives
    with torch.no_grad():
        ref = sum(reference(net, [*frozen[:k], t[k], *frozen[k + 1:]]) for k in range(len(p)))
    torch.testing.assert_close(jt, ref, **TOL)


def test_input_without_grad():
    net = tncomp.tt_linear([3, 5], [2, 7], 3)
    f = compile_net(net)
    flags = [False] + [True] * (len(net.operands) - 1)
    _grads_vs_einsum_with_flags(net, f, flags)
    plan = f.plan_for(bind(net, 6), flags, F64)
    assert plan.grad_slots[0] is None
    assert all(s is not None for s in plan.grad_slots[1:])
    full = f.plan_for(bind(net, 6), [True] * len(flags), F64)
    assert plan.backward_flops < full.backward_flops


@pytest.mark.parametrize("which", [1, 3, 4])
def test_only_one_core_with_grad(which):
    net = tncomp.tt_linear([3, 5], [2, 7], 3)
    flags = [k == which for k in range(len(net.operands))]
    _grads_vs_einsum_with_flags(net, compile_net(net), flags)


def _grads_vs_einsum_with_flags(net, f, flags):
    ts = operands(net, 6, seed=31, requires_grad=flags)
    y = f(*ts)
    assert y.requires_grad
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(32), dtype=F64)
    (y * dy).sum().backward()
    refs = [t.detach().clone().requires_grad_() for t in ts]
    (reference(net, refs) * dy).sum().backward()
    for k, (t, r) in enumerate(zip(ts, refs, strict=True)):
        if flags[k]:
            assert t.grad is not None, f"operand {k} needs a gradient"
            torch.testing.assert_close(t.grad, r.grad, **TOL)
        else:
            assert t.grad is None, f"operand {k} does not require grad"


def test_no_grad_call_has_no_grad_fn():
    net = tncomp.tt_linear([3, 5], [2, 7], 3)
    f = compile_net(net)
    ts = operands(net, 4, seed=41, requires_grad=True)
    with torch.no_grad():
        y = f(*ts)
    assert y.grad_fn is None and not y.requires_grad
    torch.testing.assert_close(y, reference(net, [t.detach() for t in ts]), **TOL)
    with torch.inference_mode():
        z = f(*ts)
    assert z.grad_fn is None and not z.requires_grad
    torch.testing.assert_close(z, y, **TOL)
    # grad mode again: the same compiled network still builds a graph
    w = f(*ts)
    assert w.grad_fn is not None and w.requires_grad


def test_no_operand_requires_grad():
    net = tncomp.from_eq("ij,jk->ik", (3, 4), (4, 2))
    ts = operands(net, seed=42)
    y = compile_net(net)(*ts)
    assert y.grad_fn is None and not y.requires_grad


def test_same_tensor_passed_twice():
    net = tncomp.from_eq("ij,jk->ik", (4, 4), (4, 4))
    a = torch.randn(4, 4, dtype=F64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    y = compile_net(net)(a, a)
    dy = torch.ones_like(y)
    (g,) = torch.autograd.grad(y, a, dy)
    ar = a.detach().clone().requires_grad_()
    (gr,) = torch.autograd.grad(ar @ ar, ar, dy)
    torch.testing.assert_close(g, gr, **TOL)


def test_repeated_steps_accumulate_and_interleave():
    """Reused buffers must not leak between steps or between outstanding graphs."""
    net = tncomp.tt_linear([12, 8, 8], [8, 8, 12], 8)
    f = compile_net(net)
    ts = operands(net, 64, seed=51, requires_grad=True)
    x2 = operands(net, 64, seed=52)[0].requires_grad_()
    dy = torch.randn((64, 8, 8, 12), generator=torch.Generator().manual_seed(53), dtype=F64)
    refs = [t.detach().clone().requires_grad_() for t in ts]
    single = torch.autograd.grad(reference(net, refs), refs, dy)
    for _ in range(3):
        (f(*ts) * dy).sum().backward()
    for t, g in zip(ts, single, strict=True):
        torch.testing.assert_close(t.grad, 3 * g, **TOL)
    # two graphs alive at once, backward in the other order, one graph twice
    y1 = f(*ts)
    y2 = f(x2, *ts[1:])
    g2 = torch.autograd.grad(y2, [x2, *ts[1:]], dy)
    g1 = torch.autograd.grad(y1, ts, dy, retain_graph=True)
    g1_again = torch.autograd.grad(y1, ts, dy)
    refs2 = [x2.detach().clone().requires_grad_(), *(r.detach().clone().requires_grad_()
                                                    for r in refs[1:])]
    want2 = torch.autograd.grad(reference(net, refs2), refs2, dy)
    for a, b, c in zip(g1, g1_again, single, strict=True):
        torch.testing.assert_close(a, c, **TOL)
        torch.testing.assert_close(b, c, **TOL)
    for a, b in zip(g2, want2, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_complex_gradients_match_einsum():
    net = tncomp.from_eq("ij,jk->ik", (2, 3), (3, 4))
    gen = torch.Generator().manual_seed(61)
    a = torch.randn(2, 3, dtype=torch.complex128, generator=gen, requires_grad=True)
    b = torch.randn(3, 4, dtype=torch.complex128, generator=gen, requires_grad=True)
    y = compile_net(net)(a, b)
    torch.testing.assert_close(y, a @ b)  # the forward is right
    dy = torch.randn(2, 4, dtype=torch.complex128, generator=gen)
    got = torch.autograd.grad(y, (a, b), dy)
    want = torch.autograd.grad(torch.einsum(einsum_eq(net), a, b), (a, b), dy)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_one_layer_used_several_times_in_one_graph():
    """A layer applied three times in a chain, and one output used twice: grads still add up."""
    net = tncomp.tt_linear([12, 8, 8], [12, 8, 8], 8)
    f = compile_net(net)
    ts = operands(net, 64, seed=71, requires_grad=True)
    refs = [t.detach().clone().requires_grad_() for t in ts]
    h = ts[0]
    rh = refs[0]
    for _ in range(3):
        h = f(h, *ts[1:])
        rh = reference(net, [rh, *refs[1:]])
    torch.testing.assert_close(h, rh, **TOL)
    dy = torch.randn(h.shape, generator=torch.Generator().manual_seed(72), dtype=F64)
    extra = f(*ts)
    ((h * dy).sum() + (extra * dy).sum() + (f(*ts) * dy).sum()).backward()
    ((rh * dy).sum() + 2 * (reference(net, refs) * dy).sum()).backward()
    for t, r in zip(ts, refs, strict=True):
        torch.testing.assert_close(t.grad, r.grad, **TOL)
