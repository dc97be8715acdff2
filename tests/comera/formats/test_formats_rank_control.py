"""Rank control on the tensor-ring, BTT and einsum-declared layers together: sizes, the soft
size, saliency pruning to a budget, then truncation, all read from the layouts."""

from __future__ import annotations

import torch
from torch import nn

import comera
from comera.formats.einsum import layout_from_eq
from comera.layers.linear import GatedLinear
from comera.ranks.objective import prune_to_, soft_size
from comera.ranks.size import model_size


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    f64 = torch.float64
    declared = layout_from_eq("b i j, a c i, j a, k c j -> b k", "a c",
                              {"i": 3, "j": 4, "k": 12}, 3)
    return nn.Sequential(
        GatedLinear(12, 12, "tr", ranks=3, in_modes=(3, 4), out_modes=(4, 3), dtype=f64),
        GatedLinear(12, 12, "btt", ranks=3, in_modes=(3, 4), out_modes=(4, 3), dtype=f64),
        GatedLinear.from_layout(declared, "einsum", dtype=f64))


def test_sizes_are_the_layouts_at_the_effective_ranks():
    model = _model()
    with torch.no_grad():
        model[0].gates[0][0] = 0.0
        model[2].gates[1][1:] = 0.0
    want = sum(m.layout.parameters_at(m.bond_ranks) + m.bias.numel() for m in model)
    assert model_size(model) == want
    assert model[0].bond_ranks == (2, 3, 3, 3) and model[2].bond_ranks == (3, 1)
    # at gates of one on the live slices, the soft size is the cores' size
    with torch.no_grad():
        for m in model:
            for g in m.gates:
                g.copy_((g.abs() > m.tau).to(g.dtype))
    cores = sum(m.layout.parameters_at(m.bond_ranks) for m in model)
    torch.testing.assert_close(soft_size(model), torch.tensor(float(cores), dtype=torch.float64))


def test_prune_to_a_budget_then_truncate_keeps_the_function():
    model = _model()
    x = torch.randn(5, 12, dtype=torch.float64)
    limit = 0.6 * model_size(model)
    prune_to_(model, limit)
    assert model_size(model) <= limit
    before = model(x).detach()
    comera.truncate_(model)
    assert all(m.bond_sizes == m.bond_ranks for m in model)
    assert model_size(model) <= limit
    torch.testing.assert_close(model(x), before, rtol=1e-10, atol=1e-12)
