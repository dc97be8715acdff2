"""zero_output_: a residual branch's output layer starts at exactly zero, in every format, and
still trains (its last core gets a gradient)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from comera.errors import ConfigError
from comera.formats.registry import DENSE, layer_formats
from comera.layers.linear import GatedLinear
from comera.layers.zero_init import zero_output_

FORMATS = [f for f in layer_formats() if f != DENSE]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("parametrization", ["balanced", "plain"])
def test_a_zeroed_layer_outputs_zero_and_its_last_core_learns(fmt, parametrization):
    torch.manual_seed(0)
    layer = GatedLinear(24, 36, fmt, 3, bias=True, parametrization=parametrization,
                        dtype=torch.float64)
    with torch.no_grad():
        layer.bias.fill_(0.5)
    assert layer.to_dense().abs().max() > 0
    assert zero_output_(layer) is layer
    x = torch.randn(5, 24, dtype=torch.float64)
    y = layer(x)
    assert torch.equal(layer.to_dense(), torch.zeros(36, 24, dtype=torch.float64))
    assert torch.equal(y, torch.zeros(5, 36, dtype=torch.float64))
    assert torch.equal(layer.bias, torch.zeros(36, dtype=torch.float64))
    # only the last core is zero: the others keep their draw, and the last one gets a gradient
    assert all(c.abs().max() > 0 for c in layer.cores[:-1])
    (y * torch.randn_like(y)).sum().backward()
    assert layer.cores[-1].grad.abs().max() > 0


def test_an_nn_linear_is_zeroed_too():
    linear = nn.Linear(8, 4)
    zero_output_(linear)
    assert torch.equal(linear(torch.randn(3, 8)), torch.zeros(3, 4))


def test_a_zeroed_layer_still_equals_its_dense_reconstruction_after_a_step():
    torch.manual_seed(1)
    layer = GatedLinear(16, 16, "btt", 2, bias=False, dtype=torch.float64)
    zero_output_(layer)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    x = torch.randn(7, 16, dtype=torch.float64)
    opt.zero_grad()
    (layer(x) - x).pow(2).sum().backward()
    opt.step()
    assert layer.to_dense().abs().max() > 0  # it moved off zero
    torch.testing.assert_close(layer(x), x @ layer.to_dense().T, rtol=1e-12, atol=1e-12)


def test_other_modules_and_meta_layers_are_refused():
    with pytest.raises(ConfigError, match=r"give a gated layer .* or an nn\.Linear"):
        zero_output_(nn.LayerNorm(4))
    meta = GatedLinear(16, 16, "btt", 2, device="meta")
    with pytest.raises(ConfigError, match="meta device"):
        zero_output_(meta)
