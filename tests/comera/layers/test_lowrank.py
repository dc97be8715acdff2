"""LowRankLinear, kept for one release: it is the ``lowrank`` format at a fixed rank, so the
model's sizes and compression ratio count it (the old class was invisible to them)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import comera
from comera.layers.lowrank import LowRankLinear
from comera.ranks.size import dense_size

F64 = torch.float64


def test_the_old_name_builds_the_lowrank_format_and_says_so():
    torch.manual_seed(0)
    with pytest.warns(DeprecationWarning, match="GatedLinear\\(format='lowrank'\\)"):
        layer = LowRankLinear(10, 6, 2, dtype=F64)
    assert type(layer) is comera.GatedLinear and layer.format.name == "lowrank"
    assert layer.ranks == (2,) and [tuple(c.shape) for c in layer.cores] == [(10, 2), (2, 6)]
    x = torch.randn(4, 10, dtype=F64)
    a, b = layer.cores
    torch.testing.assert_close(layer(x), x @ a @ b + layer.bias, rtol=1e-12, atol=1e-12)
    torch.manual_seed(0)
    assert torch.equal(comera.GatedLinear(10, 6, "lowrank", 2, dtype=F64).cores[0], a)


def test_the_model_size_and_compression_count_it():
    with pytest.warns(DeprecationWarning):
        model = nn.Sequential(LowRankLinear(10, 6, 2), nn.ReLU(), nn.Linear(6, 3))
    head = 6 * 3 + 3
    assert comera.model_size(model) == 2 * 16 + 6 + head
    assert dense_size(model) == 66 + head
    assert comera.compression_ratio(model, only=comera.GatedLinear) == pytest.approx(66 / 38)
