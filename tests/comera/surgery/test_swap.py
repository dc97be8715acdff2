"""Model surgery (comera.surgery.swap): swap submodules by name, rebuild TT layers from records."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import comera
from comera.errors import ConfigError
from comera.surgery.records import build_layer, layer_spec
from comera.surgery.swap import swap_submodule


def test_swap_submodule_by_dotted_name():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)))
    new = nn.Linear(4, 2)
    old = swap_submodule(model, "1.1", new)
    assert isinstance(old, nn.Linear) and old is not new
    assert model[1][1] is new
    with pytest.raises(AttributeError):
        swap_submodule(model, "1.9.x", new)
    with pytest.raises(ConfigError, match="the empty name"):
        swap_submodule(model, "", new)


def test_build_layer_reproduces_the_recorded_layer():
    torch.manual_seed(0)
    layer = comera.TTMLinear(12, 8, (3, 2, 2), (2, 2, 2), ranks=3, tau=0.25,
                             dtype=torch.float64)
    rebuilt = build_layer(layer_spec(layer), layer.cores[0])
    rebuilt.load_state_dict(layer.state_dict())
    assert type(rebuilt) is type(layer) and rebuilt.bonds == layer.bonds and rebuilt.tau == 0.25
    x = torch.randn(5, 12, dtype=torch.float64)
    torch.testing.assert_close(rebuilt(x), layer(x), rtol=0, atol=0)
