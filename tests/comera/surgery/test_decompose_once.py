"""convert_ decomposes each linear layer once: the converters leave the decomposition to the
pass that gives each layer its bonds and its calibration (comera/surgery/decompose.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import comera
from comera.formats.lowrank import LowRank
from comera.formats.registry import FORMATS, register_format
from comera.surgery.config import ConvertConfig


class CountedLowRank(LowRank):
    name = "lowrank_counted"
    calls = 0

    def plain_decomposition(self, weight, layout):
        type(self).calls += 1
        return super().plain_decomposition(weight, layout)


@pytest.fixture
def counted():
    register_format(CountedLowRank())
    CountedLowRank.calls = 0
    yield CountedLowRank
    del FORMATS["lowrank_counted"]


def test_a_global_allocation_decomposes_each_layer_once(counted):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 32), nn.Tanh(), nn.Linear(32, 24))
    x = torch.randn(16, 24)
    comera.convert_(model, ConvertConfig(format="lowrank_counted", target_compression=2.0,
                                         allocation="global"))
    assert counted.calls == 2
    assert torch.isfinite(model(x)).all()


@pytest.mark.parametrize("calibrated", [False, True])
def test_a_uniform_allocation_decomposes_each_layer_once(counted, calibrated):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 32), nn.Tanh(), nn.Linear(32, 24))
    x = torch.randn(16, 24)
    comera.convert_(model, ConvertConfig(format="lowrank_counted", target_compression=2.0),
                    calibration=[x] if calibrated else None)
    # plain: the hook once per layer; calibrated: the whitened decomposition, which calls it
    # twice per layer, and no plain one before it (before: 2 more, from the converters)
    assert counted.calls == (4 if calibrated else 2)
    assert torch.isfinite(model(x)).all()
