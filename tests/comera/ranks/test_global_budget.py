"""One budget across layers (comera/ranks/global_budget.py): it recovers known per-layer ranks from
planted spectra (low-rank and TT layers), never spends past the budget, is blind to a layer's
scale, and refuses a budget below every bond at rank 1, naming the least that fits."""

from __future__ import annotations

import math

import pytest
import torch

from comera.errors import ConfigError
from comera.formats.registry import get_format
from comera.ranks.global_budget import LayerSpectra, allocate_budget, estimate, floor_size

F64 = torch.float64


def planted_lowrank(n_in: int, n_out: int, rank: int, seed: int, scale: float = 1.0):
    """A weight of exact rank ``rank`` with singular values 1 ... 0.5 (float64)."""
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(n_in, rank, generator=gen, dtype=F64))
    v, _ = torch.linalg.qr(torch.randn(n_out, rank, generator=gen, dtype=F64))
    s = torch.linspace(1.0, 0.5, rank, dtype=F64)
    return scale * (u * s) @ v.T


def lowrank_spectra(name: str, weight: torch.Tensor) -> LayerSpectra:
    fmt = get_format("lowrank")
    layout = fmt.layout((weight.shape[0],), (weight.shape[1],), 1)
    return LayerSpectra(name, layout, fmt.spectra(weight, layout))


def test_recovers_planted_lowrank_ranks():
    planted = {"a": (32, 48, 3), "b": (48, 48, 9), "c": (48, 16, 5)}
    layers = [lowrank_spectra(n, planted_lowrank(i, o, r, k))
              for k, (n, (i, o, r)) in enumerate(planted.items())]
    budget = sum(r * (i + o) for i, o, r in planted.values())
    result = allocate_budget(layers, budget)
    assert result.ranks == {n: (r,) for n, (_, _, r) in planted.items()}
    assert result.size == budget
    assert all(e < 1e-6 for e in result.errors.values())


def test_recovers_planted_tt_ranks():
    fmt = get_format("tt")
    planted = {"x": ((4, 4), (4, 4), (3, 6, 2)), "y": ((4, 4), (2, 8), (2, 4, 5))}
    layers, budget = [], 0
    for k, (name, (ins, outs, ranks)) in enumerate(planted.items()):
        layout = fmt.layout(ins, outs, list(ranks))
        gen = torch.Generator().manual_seed(k)
        cores = [torch.randn(s, generator=gen, dtype=F64) for s in layout.core_shapes]
        weight = layout.dense(cores)
        layers.append(LayerSpectra(name, layout, fmt.spectra(weight, layout)))
        budget += layout.parameters_at(ranks)
    result = allocate_budget(layers, budget)
    assert result.ranks == {n: r for n, (_, _, r) in planted.items()}


def test_never_spends_past_the_budget_and_grows_with_it():
    layers = [lowrank_spectra(n, torch.randn(24, 40, generator=torch.Generator().manual_seed(k),
                                             dtype=F64)) for k, n in enumerate("pqr")]
    previous = 0
    for budget in (200, 700, 1500, 3000):
        result = allocate_budget(layers, budget)
        assert floor_size(layers) <= result.size <= budget
        assert result.size >= previous
        previous = result.size
        # the count is the layouts' own
        assert result.size == sum(s.layout.parameters_at(result.ranks[s.name]) for s in layers)


def test_blind_to_a_layers_scale():
    weights = [planted_lowrank(32, 32, 12, k) + 0.01 * torch.randn(
        32, 32, generator=torch.Generator().manual_seed(9 + k), dtype=F64) for k in range(2)]
    base = allocate_budget([lowrank_spectra(f"l{k}", w) for k, w in enumerate(weights)], 900)
    scaled = allocate_budget([lowrank_spectra("l0", weights[0] * 1000.0),
                              lowrank_spectra("l1", weights[1])], 900)
    assert base.ranks == scaled.ranks


def test_spends_where_the_energy_is():
    """Two layers of one shape: the one whose spectrum decays slowly gets the higher rank."""
    gen = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(32, 32, generator=gen, dtype=F64))
    v, _ = torch.linalg.qr(torch.randn(32, 32, generator=gen, dtype=F64))
    fast = (u * torch.logspace(0, -6, 32, dtype=F64)) @ v.T
    slow = (u * torch.linspace(1, 0.5, 32, dtype=F64)) @ v.T
    result = allocate_budget([lowrank_spectra("fast", fast), lowrank_spectra("slow", slow)],
                             20 * 64)
    assert result.ranks["slow"][0] > 3 * result.ranks["fast"][0]


def test_a_budget_below_rank_one_is_refused_naming_the_least():
    layers = [lowrank_spectra("a", torch.randn(10, 20, dtype=F64))]
    with pytest.raises(ConfigError, match=r"budget of 29 .* need 30 with every bond at rank 1"):
        allocate_budget(layers, 29)
    with pytest.raises(ConfigError, match="budget=nan"):
        allocate_budget(layers, math.nan)
    with pytest.raises(ConfigError, match="no layers"):
        allocate_budget([], 100)
    with pytest.raises(ConfigError, match="repeat"):
        allocate_budget(layers * 2, 100)


def test_spectra_must_match_the_bonds():
    layout = get_format("tt").layout((2, 2), (2, 2), 2)
    with pytest.raises(ConfigError, match="3 bonds"):
        LayerSpectra("x", layout, (torch.ones(2),))


def test_no_layer_grows_past_its_dense_size():
    """A TT layer at full rank holds more than its matrix: a generous budget stops each layer at
    its dense size instead."""
    fmt = get_format("tt")
    gen = torch.Generator().manual_seed(0)
    layers = []
    for name in ("a", "b"):
        layout = fmt.layout((4, 4), (4, 4), 1)
        weight = torch.randn(16, 16, generator=gen, dtype=F64)
        layers.append(LayerSpectra(name, layout, fmt.spectra(weight, layout)))
    result = allocate_budget(layers, 10**6)
    for s in layers:
        assert s.layout.parameters_at(result.ranks[s.name]) <= 256


# -- issue 41: Tucker leaves rank 1; uniform is the floor ---------------------------------------
def test_tucker_bonds_leave_rank_one_in_pairs():
    """A Tucker core holds a_k <= prod of the other a_j: from rank 1 no single bond may grow,
    so the allocation stayed at rank 1 whatever the budget. Two bonds now grow together, and a
    planted multilinear rank is found at its own size."""
    fmt = get_format("tucker")
    planted = (3, 2, 4, 3)
    layout = fmt.layout((6, 6), (6, 6), list(planted))
    gen = torch.Generator().manual_seed(0)
    cores = [torch.randn(s, generator=gen, dtype=F64) for s in layout.core_shapes]
    weight = layout.dense(cores)
    layers = [LayerSpectra("t", layout, fmt.spectra(weight, layout))]
    result = allocate_budget(layers, layout.parameters_at(planted))
    assert result.ranks["t"] == planted
    assert result.errors["t"] < 1e-6
    roomy = allocate_budget(layers, 4 * floor_size(layers))
    assert max(roomy.ranks["t"]) > 1


def _spectra(name: str, n: int, shares: list[float]) -> LayerSpectra:
    layout = get_format("lowrank").layout((n,), (n,), 1)
    values = torch.zeros(n, dtype=F64)
    values[:len(shares)] = torch.tensor(shares, dtype=F64).sqrt()
    return LayerSpectra(name, layout, (values,))


def test_uniform_ranks_come_back_where_their_estimate_is_lower():
    """The greedy spend takes the small layer's cheap slices first (more gain per parameter)
    and then has no room for the wide layer's one valuable slice: 0.25 against uniform's 0.16."""
    layers = [_spectra("wide", 64, [0.5, 0.5]), _spectra("small", 16, [0.6, 0.1, 0.1, 0.1, 0.1])]
    budget = 2 * 128 + 32
    alone = allocate_budget(layers, budget)
    assert alone.ranks == {"wide": (1,), "small": (5,)} and alone.kept == "global"
    assert alone.estimate == pytest.approx(0.25)
    uniform = {"wide": (2,), "small": (1,)}
    result = allocate_budget(layers, budget, uniform)
    assert result.kept == "uniform" and result.ranks == uniform
    assert result.estimate == pytest.approx(0.25)
    assert result.uniform_estimate == pytest.approx(0.16) == estimate(layers, uniform)
    assert result.size == 2 * 128 + 32 and "uniform ranks kept" in str(result)
    assert result.errors["wide"] < 1e-7 and result.errors["small"] == pytest.approx(0.4**0.5)


def test_global_ranks_are_kept_where_their_estimate_is_lower():
    layers = [_spectra("a", 32, [0.9, 0.1]), _spectra("b", 32, [0.25] * 4)]
    uniform = {"a": (2,), "b": (2,)}  # two slices each
    result = allocate_budget(layers, 4 * 64, uniform)
    assert result.kept == "global" and result.ranks == {"a": (1,), "b": (3,)}
    assert result.estimate < result.uniform_estimate == estimate(layers, uniform)


def test_uniform_ranks_are_checked():
    layers = [_spectra("a", 8, [1.0])]
    with pytest.raises(ConfigError, match="uniform ranks for layer 'a'"):
        allocate_budget(layers, 64, {"a": (0,)})
    with pytest.raises(ConfigError, match="over the budget"):
        allocate_budget(layers, 20, {"a": (2,)})
