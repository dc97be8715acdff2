"""The spectrum allocation: exact bond spectra, the known best allocation of layers whose true
ranks differ, exact application, the uniform floor, and the rank-1 warning."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import comera
from comera import LateStage, TTLinear
from comera.formats.registry import DENSE, get_format, layer_formats
from comera.ranks.allocate import (
    RankOneWarning,
    allocate,
    allocate_,
    bond_spectra,
    check_chain_format,
    check_chains,
    layer_size,
    rebuild_at_,
    uniform_ranks,
)
from comera.ranks.truncate import truncate_

F64 = torch.float64
MODES = (4, 4, 4)  # 64 x 64 as 6 cores of 4
pytestmark = pytest.mark.usefixtures("one_thread")

# true inner bonds of three layers: each differs, and each fits its neighbours' bounds
TRUE = [(2, 3, 4, 3, 2), (1, 1, 2, 1, 1), (4, 4, 4, 4, 4)]


def _layer_of_rank(ranks, noise: float, seed: int) -> TTLinear:
    """A rank-8 TTLinear holding (by TT-SVD) a weight of exact TT ``ranks`` plus noise."""
    torch.manual_seed(seed)
    truth = TTLinear(64, 64, MODES, MODES, ranks=list(ranks), bias=False, dtype=F64)
    with torch.no_grad():
        for core in truth.cores:
            core.normal_()
    weight = truth.to_dense()  # (out, in)
    weight = weight / weight.norm() + noise * torch.randn_like(weight) / 64
    linear = nn.Linear(64, 64, bias=False, dtype=F64)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return TTLinear.from_linear(linear, ranks=8, in_modes=MODES, out_modes=MODES)


def _model(noise: float = 1e-4) -> nn.Sequential:
    return nn.Sequential(*(_layer_of_rank(r, noise, seed) for seed, r in enumerate(TRUE)))


def test_bond_spectra_are_the_singular_values_of_each_unfolding():
    layer = _layer_of_rank(TRUE[0], 1e-3, 0)
    weight = layer.to_dense().T.reshape(*MODES, *MODES)  # (i1, i2, i3, o1, o2, o3)
    spectra = bond_spectra(layer)
    for k, s in enumerate(spectra):
        left = math.prod((MODES + MODES)[:k + 1])
        expected = torch.linalg.svdvals(weight.reshape(left, -1).detach())
        expected = expected[:s.numel()]
        torch.testing.assert_close(s, expected, rtol=1e-9, atol=1e-12)


def test_allocation_finds_the_true_ranks_under_the_matching_budget():
    """Three layers of different true TT ranks, stored at rank 8 with noise: under the budget
    the true ranks cost, the allocation is exactly the true ranks (not a uniform rank)."""
    model = _model()
    budget = sum(layer_size(m, (1, *r, 1)) for m, r in zip(model, TRUE, strict=True))
    allocation = allocate(model, budget, floor="one")
    assert [allocation.ranks[str(i)][1:-1] for i in range(3)] == TRUE
    assert allocation.size == budget
    # the uniform rank at the same budget keeps less of the weight: here it is 2
    assert allocation.uniform_rank == 2


def test_allocate_applies_the_allocation_exactly():
    model = _model(noise=1e-3)
    before = [m.to_dense().detach().clone() for m in model]
    spectra = [bond_spectra(m) for m in model]
    budget = sum(layer_size(m, (1, *r, 1)) for m, r in zip(model, TRUE, strict=True))
    allocation = allocate_(model, budget, floor="one")
    assert comera.model_size(model) == allocation.size <= budget
    for m, w, s, name in zip(model, before, spectra, ("0", "1", "2"), strict=True):
        ranks = allocation.ranks[name]
        assert m.ranks == ranks
        discarded = sum(float(v[r:].square().sum()) for v, r in zip(s, ranks[1:-1], strict=True))
        error = float((m.to_dense().detach() - w).norm())
        assert error <= math.sqrt(discarded) * (1 + 1e-6)  # the TT truncation bound
        assert error < 2e-3  # only the noise went
    truncate_(model)  # physically: the stored bonds are the allocation
    assert [m.bonds for m in model] == [allocation.ranks[n] for n in ("0", "1", "2")]


def test_the_uniform_floor_keeps_every_uniform_slice():
    model = _model()
    budget = sum(layer_size(m, (1, *r, 1)) for m, r in zip(model, TRUE, strict=True))
    _, uniform = uniform_ranks(model, budget)
    allocation = allocate(model, budget)  # floor="uniform", the default
    assert allocation.uniform == uniform and allocation.size <= budget
    for name, ranks in allocation.ranks.items():
        assert all(a >= u for a, u in zip(ranks, uniform[name], strict=True)), (name, ranks)
    fresh = nn.Sequential(*(TTLinear(64, 64, MODES, MODES, ranks=r, bias=False) for r in (3, 3)))
    big = nn.Sequential(*(TTLinear(64, 64, MODES, MODES, ranks=8, bias=False) for _ in range(2)))
    assert uniform_ranks(big, comera.model_size(fresh))[0] == 3
    assert uniform_ranks(big, comera.model_size(fresh) - 1)[0] == 2


def test_a_budget_that_leaves_a_layer_at_rank_one_warns():
    model = _model()
    with pytest.warns(RankOneWarning, match=r"rank 1 on every bond \(1\)"):
        allocate_(model, sum(layer_size(m, (1,) * 7) for m in model) + 40, floor="one")


def test_a_nan_core_is_a_non_finite_error_naming_the_layer():
    """A diverged model (a NaN core) under a spectrum allocation: a NonFiniteError naming the
    layer, not torch's raw _LinAlgError from the QR sweep; nothing is changed."""
    model = _model()
    with torch.no_grad():
        model[1].cores[2][0, 0, 0] = float("nan")
    ranks = [m.ranks for m in model]
    with pytest.raises(comera.NonFiniteError, match=r"layer 1: its cores .* NaN or infinite"):
        allocate_(model, comera.model_size(model) // 2)
    assert [m.ranks for m in model] == ranks
    with pytest.raises(comera.NonFiniteError, match="layer <model>"):
        bond_spectra(model[1])


def test_allocate_rejects_bad_input():
    model = _model()
    with pytest.raises(comera.ConfigError, match="floor='two'"):
        allocate(model, 1000, floor="two")
    with pytest.raises(comera.ConfigError, match="target_size=0"):
        allocate(model, 0)
    with pytest.raises(comera.ConfigError, match="no live TT layers"):
        allocate(nn.Sequential(nn.Linear(2, 2)), 10)


def test_late_stage_allocates_at_its_start_and_trains_the_shape():
    """allocation="spectrum": the trainer's late stage allocates when it starts (the true
    ranks), and the step budget has nothing left to prune."""
    model = _model(noise=1e-3)
    budget = sum(layer_size(m, (1, *r, 1)) for m, r in zip(model, TRUE, strict=True))
    trainer = comera.CoMERATrainer(model)
    stage = LateStage(budget, steps=2, floor="one", allocation="spectrum")
    assert LateStage(budget).allocation == "prune"  # the default: the pruning schedule
    trainer.start_late_stage(stage)
    assert trainer.controller.state_dict()["late"]["allocation"] == "spectrum"
    assert [m.ranks[1:-1] for m in model] == TRUE
    x = torch.randn(16, 64, dtype=F64)
    for _ in range(2):
        stats = trainer.step(model(x).square().mean())
        assert stats.size <= budget
    assert stage.allocate_(model) is None  # it fits: nothing to do
    with pytest.raises(comera.ConfigError, match="allocation='svd'"):
        LateStage(10.0, allocation="svd")
    with pytest.raises(comera.ConfigError, match="floor='none'"):
        LateStage(10.0, floor="none")


def test_rebuild_at_trains_the_chosen_shape_from_a_fresh_init():
    model = _model()
    budget = sum(layer_size(m, (1, *r, 1)) for m, r in zip(model, TRUE, strict=True))
    allocation = allocate(model, budget, floor="one")
    old = [m.to_dense().detach() for m in model]
    torch.manual_seed(3)
    rebuild_at_(model, allocation.ranks)
    assert [m.bonds for m in model] == [allocation.ranks[n] for n in ("0", "1", "2")]
    assert comera.model_size(model) == allocation.size
    assert all(c.dtype == F64 for m in model for c in m.cores)
    x = torch.randn(4, 64, dtype=F64)
    assert model(x).shape == (4, 64)
    assert all(not torch.allclose(m.to_dense(), w) for m, w in zip(model, old, strict=True))
    with pytest.raises(comera.ConfigError, match=r"ranks name \['7'\]"):
        rebuild_at_(model, {"7": (1, 2, 1)})


def test_from_ratio_allocation_leaves_no_wasted_bond_and_no_rank_one_layer():
    """Issue 23: LateStage.from_ratio(model, 10) once drove a layer to ranks
    (1, 6, 1, 1, 1, 1, 1), where the 6 costs parameters and carries nothing. The spectrum
    allocation lands at the target with every bond within what its neighbours allow."""
    import warnings

    from comera.ranks.truncate import excess_bonds

    torch.manual_seed(0)
    model = nn.Sequential(TTLinear(64, 256, ranks=8, bias=False), nn.GELU(),
                          TTLinear(256, 64, ranks=8, bias=False))
    stage = LateStage.from_ratio(model, 4.0, steps=100, allocation="spectrum")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RankOneWarning)
        allocation = stage.allocate_(model)
    assert comera.model_size(model) == allocation.size <= stage.target_size
    assert allocation.size >= 0.9 * stage.target_size
    assert all(not excess_bonds(m) for m in (model[0], model[2]))
    assert all(min(m.ranks[1:-1]) >= allocation.uniform_rank for m in (model[0], model[2]))


@pytest.mark.parametrize("fmt", [f for f in layer_formats() if f != DENSE])
def test_the_format_level_check_agrees_with_the_layers_it_builds(fmt):
    """check_chain_format (before any model) refuses exactly the formats whose layers
    check_chains refuses."""
    modes = {"in_modes": (4, 4), "out_modes": (4, 4)} if get_format(fmt).uses_modes else {}
    layer = comera.GatedLinear(16, 16, format=fmt, ranks=2, **modes)
    try:
        check_chains([("x", layer)])
        chain = True
    except comera.ConfigError:
        chain = False
    if chain:
        check_chain_format(fmt)
    else:
        with pytest.raises(comera.ConfigError, match="tensor-train chains"):
            check_chain_format(fmt)
    assert chain == (fmt in ("tt", "ttm"))
