"""The layer class of a format (comera/layers/classes.py): an explicit table, not a walk over
GatedLinear's subclasses; TTLinear and TTMLinear are thin constructors of GatedLinear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import comera
from comera.errors import ConfigError
from comera.layers.classes import LINEAR_CLASSES, linear_class, register_linear_class
from comera.layers.linear import GatedLinear, TTLinear, TTMLinear


def test_each_format_has_its_class():
    assert linear_class("tt") is TTLinear
    assert linear_class("ttm") is TTMLinear
    assert linear_class("tucker") is GatedLinear


def test_a_subclass_changes_nothing_until_registered():
    class TuckerLinear(GatedLinear):
        fixed_format = "tucker"

    assert linear_class("tucker") is GatedLinear  # defined is not registered
    saved = dict(LINEAR_CLASSES)
    try:
        assert register_linear_class(TuckerLinear) is TuckerLinear
        assert linear_class("tucker") is TuckerLinear
        model = nn.Sequential(nn.Linear(12, 12))
        comera.convert_(model, format="tucker", ranks=2)
        assert type(model[0]) is TuckerLinear
    finally:
        LINEAR_CLASSES.clear()
        LINEAR_CLASSES.update(saved)


@pytest.mark.parametrize("bad", [GatedLinear, nn.Linear, "tt"])
def test_register_refuses_what_is_not_a_fixed_format_layer(bad):
    with pytest.raises(ConfigError, match="register_linear_class"):
        register_linear_class(bad)


@pytest.mark.parametrize("cls", [TTLinear, TTMLinear])
def test_tt_classes_are_thin_constructors(cls):
    own = {k for k in vars(cls) if not k.startswith("__")}
    assert own == {"fixed_format"}
    layer = cls(12, 20, (3, 4), (4, 5), ranks=3, dtype=torch.float64)
    assert isinstance(layer, GatedLinear) and layer.format.name == cls.fixed_format
    same = GatedLinear(12, 20, cls.fixed_format, 3, (3, 4), (4, 5), dtype=torch.float64)
    assert layer.layout == same.layout
    x = torch.randn(5, 12, dtype=torch.float64)
    torch.testing.assert_close(layer(x), x @ layer.to_dense().T + layer.bias)
