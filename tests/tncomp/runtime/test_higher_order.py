"""Second (and higher) derivatives through compiled networks, against torch.einsum.

The backward of a contraction is a set of contractions over the same network: with
``create_graph=True`` tncomp builds the gradients from differentiable torch ops, so gradient
penalties, Hessian-vector products and MAML-style inner steps see the true second derivative
(before: the first-order gradients were cut off from the graph and the penalty added nothing).
"""

from __future__ import annotations

import pytest
import torch

import tncomp
from tests.helpers.tn import F64, compile_net, operands, reference

NETS = {
    "tt_d2": lambda: tncomp.tt_linear([2, 3], [3, 2], [2, 1, 2]),
    "ttm_d2": lambda: tncomp.ttm_linear([2, 3], [3, 2], 2),
    "embedding_d2": lambda: tncomp.ttm_embedding([2, 3], [3, 2], 2),
    "eq_matmul": lambda: tncomp.from_eq("bi,ij->bj", ("B", 3), (3, 2)),
    "eq_hyperedge": lambda: tncomp.from_eq("bij,bjk->bik", ("B", 2, 3), ("B", 3, 2)),
    "eq_full_reduction": lambda: tncomp.from_eq("ij,jk,ki->", (2, 3), (3, 2), (2, 2)),
}
TOL = {"rtol": 1e-9, "atol": 1e-10}


def _pair(net, batch, seed):
    ts = operands(net, batch, seed=seed, requires_grad=True)
    return ts, [t.detach().clone().requires_grad_() for t in ts]


@pytest.mark.parametrize("name", sorted(NETS))
def test_gradgradcheck(name, one_thread):
    net = NETS[name]()
    f = compile_net(net)
    ts = operands(net, 2, seed=3, requires_grad=True)
    assert torch.autograd.gradgradcheck(f, tuple(ts), eps=1e-6, atol=1e-7, rtol=1e-6)


def test_gradient_penalty_matches_einsum(one_thread):
    """The issue's case: a loss linear in y plus the squared gradient norm."""
    net = tncomp.from_eq("bi,ij->bj", ("B", 5), (5, 4))
    f = compile_net(net)
    (x, w), (rx, rw) = _pair(net, 6, seed=1)
    for fn, xs in ((f, (x, w)), (lambda *a: reference(net, a), (rx, rw))):
        y = fn(*xs)
        (gx,) = torch.autograd.grad(y.sum(), xs[0], create_graph=True)
        (y.sum() + gx.pow(2).sum()).backward()
    torch.testing.assert_close(w.grad, rw.grad, **TOL)
    torch.testing.assert_close(x.grad, rx.grad, **TOL)
    # the penalty contributes: without it the gradient of w would differ
    plain = torch.autograd.grad(reference(net, [rx, rw]).sum(), rw)[0]
    assert not torch.allclose(plain, rw.grad)


def test_hessian_vector_product_matches_einsum(one_thread):
    net = tncomp.tt_linear([2, 3], [3, 2], 2)
    f = compile_net(net)
    ts, refs = _pair(net, 4, seed=2)
    gen = torch.Generator().manual_seed(5)
    vs = [torch.randn(t.shape, generator=gen, dtype=F64) for t in ts]

    def hvp(fn, xs):
        loss = fn(*xs).sin().sum()
        grads = torch.autograd.grad(loss, xs, create_graph=True)
        dot = sum((g * v).sum() for g, v in zip(grads, vs, strict=True))
        return torch.autograd.grad(dot, xs)

    got = hvp(f, ts)
    want = hvp(lambda *a: reference(net, a), refs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)


def test_maml_inner_step_matches_einsum(one_thread):
    """Meta-gradient through one inner SGD step on the cores (second order in the cores)."""
    net = tncomp.tt_linear([2, 3], [3, 2], 2)
    f = compile_net(net)
    gen = torch.Generator().manual_seed(9)
    x_in = torch.randn(5, 2, 3, generator=gen, dtype=F64)
    x_out = torch.randn(5, 2, 3, generator=gen, dtype=F64)
    target = torch.randn(5, 3, 2, generator=gen, dtype=F64)
    cores = operands(net, 5, seed=4, requires_grad=True)[1:]
    refs = [c.detach().clone().requires_grad_() for c in cores]

    def meta_loss(fn, params):
        inner = (fn(x_in, *params) - target).pow(2).mean()
        grads = torch.autograd.grad(inner, params, create_graph=True)
        adapted = [p - 0.1 * g for p, g in zip(params, grads, strict=True)]
        return (fn(x_out, *adapted) - target).pow(2).mean()

    meta_loss(f, cores).backward()
    meta_loss(lambda *a: reference(net, a), refs).backward()
    for c, r in zip(cores, refs, strict=True):
        torch.testing.assert_close(c.grad, r.grad, **TOL)


def test_third_derivative(one_thread):
    net = tncomp.from_eq("i,ij,j->", (3,), (3, 3), (3,))
    f = compile_net(net)
    x, a, _ = operands(net, seed=6)
    x.requires_grad_()
    for fn in (f, lambda *t: reference(net, t)):
        y = fn(x, a, x) ** 2  # (x^T A x)^2: a quartic in x
        g1 = torch.autograd.grad(y, x, create_graph=True)[0]
        g2 = torch.autograd.grad(g1.sum(), x, create_graph=True)[0]
        g3 = torch.autograd.grad(g2.sum(), x)[0]
        if fn is f:
            got = g3
    torch.testing.assert_close(got, g3, **TOL)


def test_first_order_backward_builds_no_graph(one_thread):
    """Without create_graph the fast path runs: gradients carry no graph."""
    net = tncomp.tt_linear([2, 3], [3, 2], 2)
    f = compile_net(net)
    ts = operands(net, 3, seed=8, requires_grad=True)
    grads = torch.autograd.grad(f(*ts).sum(), ts)
    assert all(g.grad_fn is None for g in grads)
