"""torch.func over models with compiled networks: grad, vjp, vmap and per-sample gradients,
each against autograd (or a loop) on the same model."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vjp, vmap

import tncomp
from tests.helpers.tn import compile_net, operands, reference

TOL = {"rtol": 1e-9, "atol": 1e-10}


@pytest.fixture
def model():
    from comera.layers.linear import TTLinear

    torch.manual_seed(0)
    net = nn.Sequential(TTLinear(24, 16, ranks=3), nn.Tanh(), TTLinear(16, 8, ranks=3))
    return net.double()


def _data():
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(5, 24, generator=gen, dtype=torch.float64),
            torch.randn(5, 8, generator=gen, dtype=torch.float64))


def test_func_grad_of_functional_call_matches_autograd(model, one_thread):
    x, target = _data()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p):
        return (functional_call(model, p, (x,)) - target).pow(2).mean()

    got = grad(loss)(params)
    model.zero_grad()
    (model(x) - target).pow(2).mean().backward()
    assert got.keys() == params.keys()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, **TOL, msg=name)


def test_func_vjp_matches_autograd(model, one_thread):
    x, target = _data()
    params = {k: v.detach() for k, v in model.named_parameters()}
    y, pull = vjp(lambda p: functional_call(model, p, (x,)), params)
    (got,) = pull(target)
    model.zero_grad()
    out = model(x)
    torch.testing.assert_close(y, out.detach(), **TOL)
    out.backward(target)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, **TOL, msg=name)


def test_vmap_matches_a_loop(one_thread):
    net = tncomp.tt_linear([2, 3], [3, 2], 2)
    f = compile_net(net)
    x, *cores = operands(net, 4, seed=2)
    stacked = torch.stack([x, 2 * x, -x])  # (3, B, 2, 3)
    got = vmap(lambda xb: f(xb, *cores))(stacked)
    want = torch.stack([reference(net, [xb, *cores]) for xb in stacked])
    torch.testing.assert_close(got, want, **TOL)


def test_per_sample_gradients(model, one_thread):
    """vmap(grad(...)): one gradient per example, as a loop of autograd calls gives."""
    x, target = _data()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, ti):
        return (functional_call(model, p, (xi[None],)) - ti[None]).pow(2).sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, target)
    for i in range(x.shape[0]):
        model.zero_grad()
        (model(x[i:i + 1]) - target[i:i + 1]).pow(2).sum().backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(per_sample[name][i], p.grad, **TOL, msg=name)
