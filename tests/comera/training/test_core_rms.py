"""The per-core RMS bound: a projection (cores inside the bound untouched, cores outside scaled
exactly onto it, W scaled with them), after each optimizer step or before each training
forward, with clear refusals."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from comera.errors import ConfigError
from comera.formats.scaling import core_scaling
from comera.layers.linear import GatedLinear
from comera.training.core_rms import bound_core_rms_, core_rms_bounds, keep_core_rms_bounded


def _rms(t: torch.Tensor) -> float:
    return float(t.detach().pow(2).mean().sqrt())


def _layer(parametrization="balanced", fmt="btt") -> GatedLinear:
    torch.manual_seed(0)
    return GatedLinear(32, 48, fmt, 2, bias=False, parametrization=parametrization,
                       dtype=torch.float64)


@pytest.mark.parametrize("parametrization", ["balanced", "plain"])
def test_the_bound_is_the_balanced_initial_rms_of_the_effective_core(parametrization):
    layer = _layer(parametrization)
    stds = core_scaling(layer.layout).stds
    bounds = core_rms_bounds(layer, 2.0)
    for bound, std, scale in zip(bounds, stds, layer.core_scale_values, strict=True):
        assert bound == pytest.approx(2.0 * std / scale, rel=1e-15)
    if parametrization == "balanced":  # a fresh balanced layer sits on its bound
        for core, bound in zip(layer.cores, core_rms_bounds(layer), strict=True):
            assert _rms(core) == pytest.approx(bound, rel=1e-12)


def test_a_core_outside_is_scaled_onto_the_bound_and_one_inside_is_untouched():
    layer = _layer()
    with torch.no_grad():
        layer.cores[0].mul_(3.0)   # outside
        layer.cores[1].mul_(0.5)   # inside
    before = [c.detach().clone() for c in layer.cores]
    w = layer.to_dense().detach()
    bound_core_rms_(layer)
    bounds = core_rms_bounds(layer)
    assert _rms(layer.cores[0]) == pytest.approx(bounds[0], rel=1e-12)
    assert torch.equal(layer.cores[1], before[1])
    # W is multilinear in the cores: it shrank by exactly the first core's factor
    factor = bounds[0] / _rms(before[0])
    torch.testing.assert_close(layer.to_dense(), w * factor, rtol=1e-12, atol=1e-14)
    x = torch.randn(4, 32, dtype=torch.float64)
    torch.testing.assert_close(layer(x), x @ layer.to_dense().T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fmt", ["btt", "ttm", "lowrank"])
def test_after_every_optimizer_step_the_cores_are_within_their_bounds(fmt):
    layer = _layer(fmt=fmt)
    opt = torch.optim.Adam(layer.parameters(), lr=0.5)  # large steps: the cores grow
    handle = keep_core_rms_bounded(layer, 1.5, optimizer=opt)
    x = torch.randn(16, 32, dtype=torch.float64)
    target = 10 * torch.randn(16, 48, dtype=torch.float64)
    for _ in range(3):
        opt.zero_grad()
        (layer(x) - target).pow(2).mean().backward()
        opt.step()
        for core, bound in zip(layer.cores, core_rms_bounds(layer, 1.5), strict=True):
            assert _rms(core) <= bound * (1 + 1e-12)
    assert any(_rms(c) == pytest.approx(b, rel=1e-12)
               for c, b in zip(layer.cores, core_rms_bounds(layer, 1.5), strict=True))
    handle.remove()  # no bound any more: a step moves the cores past it
    opt.zero_grad()
    (layer(x) - target).pow(2).mean().backward()
    opt.step()
    assert any(_rms(c) > b * 1.01 for c, b in zip(layer.cores, core_rms_bounds(layer, 1.5),
                                                  strict=True))


def test_without_an_optimizer_the_bound_runs_before_each_training_forward():
    layer = _layer()
    model = nn.Sequential(layer, nn.Tanh())
    keep_core_rms_bounded(model)
    with torch.no_grad():
        layer.cores[1].mul_(4.0)
    model.eval()
    model(torch.randn(2, 32, dtype=torch.float64))
    assert _rms(layer.cores[1]) > 2 * core_rms_bounds(layer)[1]  # not in eval mode
    model.train()
    model(torch.randn(2, 32, dtype=torch.float64))
    assert _rms(layer.cores[1]) == pytest.approx(core_rms_bounds(layer)[1], rel=1e-12)


def test_a_zero_core_stays_zero():
    layer = _layer()
    with torch.no_grad():
        layer.cores[-1].zero_()
    bound_core_rms_(layer)
    assert torch.equal(layer.cores[-1], torch.zeros_like(layer.cores[-1]))
    assert all(math.isfinite(_rms(c)) for c in layer.cores)


@pytest.mark.parametrize("factor", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_a_bad_factor_is_refused(factor):
    with pytest.raises(ConfigError, match=r"factor=.*finite number > 0"):
        bound_core_rms_(_layer(), factor)


def test_modules_without_gated_layers_and_foreign_optimizers_are_refused():
    with pytest.raises(ConfigError, match="no gated layers"):
        keep_core_rms_bounded(nn.Linear(4, 4))
    layer = _layer()
    other = torch.optim.SGD(nn.Linear(4, 4).parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="holds none of the module's cores"):
        keep_core_rms_bounded(layer, optimizer=other)
    with pytest.raises(ConfigError, match=r"torch\.optim\.Optimizer"):
        keep_core_rms_bounded(layer, optimizer="adam")
    with pytest.raises(ConfigError, match="give a gated layer"):
        core_rms_bounds(nn.Linear(4, 4))
