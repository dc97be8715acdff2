"""LowRankLinear: equals its dense reconstruction, gradients, from_linear, budgets, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from comera import ConfigError, model_size
from comera.layers.lowrank import LowRankLinear, lowrank_sizes, rank_for_size

F64 = torch.float64


def _layer(in_f=7, out_f=5, rank=3, bias=True):
    torch.manual_seed(0)
    layer = LowRankLinear(in_f, out_f, rank, bias=bias, dtype=F64)
    if bias:
        with torch.no_grad():
            layer.bias.normal_()
    return layer


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(4,), (2, 3), ()])
def test_forward_equals_dense_reconstruction(bias, lead):
    layer = _layer(bias=bias)
    x = torch.randn(*lead, 7, dtype=F64)
    dense = x @ layer.to_dense().T + (layer.bias if bias else 0)
    torch.testing.assert_close(layer(x), dense, rtol=1e-12, atol=1e-12)
    assert layer(x).shape == (*lead, 5)


def test_dense_weight_has_the_rank():
    layer = _layer(12, 9, 2)
    assert torch.linalg.matrix_rank(layer.to_dense()).item() == 2


@pytest.mark.parametrize("bias", [True, False])
def test_gradcheck(bias):
    layer = _layer(5, 4, 2, bias=bias)
    x = torch.randn(3, 5, dtype=F64, requires_grad=True)
    params = [layer.A, layer.B] + ([layer.bias] if bias else [])

    def f(x, a, b, *rest):
        y = x @ a @ b
        return y + rest[0] if rest else y

    assert torch.autograd.gradcheck(f, (x, *params))
    # the module's own gradients equal those of the dense-reconstruction formula
    out = torch.randn(3, 4, dtype=F64)
    (layer(x) * out).sum().backward()
    got = [p.grad.clone() for p in (x, *params)]
    for p in (x, *params):
        p.grad = None
    (f(x, *params) * out).sum().backward()
    for g, p in zip(got, (x, *params), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("in_f", "out_f"), [(6, 4), (4, 6), (5, 5)])
@pytest.mark.parametrize("bias", [True, False])
def test_from_linear_at_full_rank_reproduces_the_linear(in_f, out_f, bias):
    torch.manual_seed(1)
    linear = nn.Linear(in_f, out_f, bias=bias, dtype=F64)
    layer = LowRankLinear.from_linear(linear, min(in_f, out_f))
    x = torch.randn(8, in_f, dtype=F64)
    torch.testing.assert_close(layer(x), linear(x), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer.to_dense(), linear.weight, rtol=1e-10, atol=1e-12)


def test_from_linear_truncated_is_the_best_rank_r_approximation():
    torch.manual_seed(2)
    linear = nn.Linear(10, 8, dtype=F64)
    s = torch.linalg.svdvals(linear.weight)
    layer = LowRankLinear.from_linear(linear, 3)
    err = torch.linalg.matrix_norm(layer.to_dense() - linear.weight)
    torch.testing.assert_close(err, s[3:].pow(2).sum().sqrt(), rtol=1e-10, atol=1e-12)
    assert layer.A.dtype == F64 and layer.rank == 3


def test_default_init_scale():
    torch.manual_seed(3)
    layer = LowRankLinear(300, 200, 16)
    var = layer.to_dense().var().item()
    assert 0.7 / 500 < var < 1.3 / 500


@pytest.mark.parametrize(("in_f", "out_f", "bias"), [(256, 256, True), (128, 512, False),
                                                     (192, 768, True)])
@pytest.mark.parametrize("ratio", [4, 8, 16, 32])
def test_rank_for_size_is_the_largest_rank_within_the_budget(in_f, out_f, bias, ratio):
    params = (in_f * out_f + (out_f if bias else 0)) // ratio
    r = rank_for_size(in_f, out_f, params, bias=bias)
    size = LowRankLinear(in_f, out_f, r, bias=bias).num_parameters()
    assert size <= params
    assert LowRankLinear(in_f, out_f, r + 1, bias=bias).num_parameters() > params


def test_rank_for_size_caps_at_full_rank():
    assert rank_for_size(6, 4, 10_000) == 4


def test_rank_for_size_errors_when_rank_one_does_not_fit():
    with pytest.raises(ConfigError, match="at least 15"):
        rank_for_size(7, 4, 14)


def test_sizes_are_counted():
    model = nn.Sequential(LowRankLinear(10, 6, 2), nn.ReLU(), nn.Linear(6, 3))
    assert lowrank_sizes(model) == (2 * 16 + 6, 66)
    assert model_size(model) == 38 + 21  # true size: counted as ordinary parameters
    assert model[0].num_parameters(effective=False) == model[0].num_parameters()


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_rank_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="rank="):
        LowRankLinear(4, 4, bad)


def test_bad_input_and_from_linear_errors():
    layer = LowRankLinear(4, 3, 2)
    with pytest.raises(ConfigError, match="4 features"):
        layer(torch.randn(2, 5))
    with pytest.raises(ConfigError, match="rank <= 3"):
        LowRankLinear.from_linear(nn.Linear(4, 3), 4)
    with pytest.raises(ConfigError, match=r"nn\.Linear"):
        LowRankLinear.from_linear(layer, 1)
