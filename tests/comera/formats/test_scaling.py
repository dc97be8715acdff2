"""The balanced parametrization (comera/formats/scaling.py): every format's weight starts with the
variance of nn.Linear's default initialisation, every core's relative update under Adam is the
same within the powers of two, decompositions stay exact, and checkpoints of either
parametrization load back exactly."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch import nn

import comera
from comera.formats.registry import format_names, get_format
from comera.formats.scaling import balance_gauge, core_scaling, orthogonal_cores
from comera.training.relative_updates import relative_updates

FORMATS = [f for f in format_names() if get_format(f).from_modes]
F64 = torch.float64


def _layer(fmt: str, parametrization: str = "balanced", **kw) -> comera.GatedLinear:
    ranks = kw.pop("ranks", 4)
    if get_format(fmt).uses_modes:
        kw |= {"in_modes": (2, 3, 4), "out_modes": (3, 3, 4)}
    return comera.GatedLinear(24, 36, format=fmt, ranks=ranks, bias=False,
                              parametrization=parametrization, **kw)


def test_core_roles_read_each_core_as_a_layer_of_the_flow():
    tt = get_format("tt").layout((2, 3), (4, 5), 3)  # cores (1,2,2) (2,3,3) (3,4,3) (3,5,1)
    # input side: (r, i) -> r'; output side: r -> (o, r'); the size-1 ends count in the fan-in
    assert tt.core_fans() == ((2, 2), (6, 3), (3, 12), (3, 5))
    btt = get_format("btt").layout((2, 3), (4, 5), 2)
    # core 1 (i1, i2, o1, r1): i2 is a block index (needed by core 2), i1 summed
    assert btt.core_roles()[0] == ((1,), (0,), (2, 3))
    cp = get_format("cp").layout((2, 3), (4, 5), 6)
    assert [f for f, _ in cp.core_fans()] == [2, 3, 1, 6]  # the hyperedge is summed last


@pytest.mark.parametrize("fmt", FORMATS)
def test_fan_ins_multiply_to_the_inputs_times_the_internal_sizes(fmt):
    layout = _layer(fmt).layout
    internal = math.prod(layout.size(i) for i in layout.internal)
    assert math.prod(f for f, _ in layout.core_fans()) == layout.in_features * internal


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_weight_starts_with_nn_linears_variance(fmt):
    """Statistically: the mean over seeds of var(W) * 3 * in_features is 1, within 4 standard
    errors of the seeds' spread, and so is nn.Linear's own."""
    def ratio(make) -> float:
        w = make().detach().double()
        return float(w.var(unbiased=False) + w.mean() ** 2) * 3 * 24

    gated = []
    for seed in range(40):
        torch.manual_seed(seed)
        gated.append(ratio(lambda: _layer(fmt).to_dense()))
    mean, err = statistics.fmean(gated), statistics.stdev(gated) / math.sqrt(len(gated))
    assert abs(mean - 1.0) < max(4 * err, 0.02), (fmt, mean, err)
    dense = []
    for seed in range(40):
        torch.manual_seed(seed)
        dense.append(ratio(lambda: nn.Linear(24, 36).weight))
    assert abs(statistics.fmean(dense) - 1.0) < 0.05  # the reference it matches


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_core_moves_alike_under_adam(fmt):
    """One AdamW step on a fixed seed: Adam's first step moves every stored entry by the
    learning rate, so a core's relative update is lr * multiplier / its rms; the balanced
    multipliers make it the same for every core up to their powers of two (a factor 2)."""
    torch.manual_seed(0)
    model = nn.Sequential(_layer(fmt, dtype=F64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    model(torch.randn(32, 24, dtype=F64)).square().sum().backward()
    update = relative_updates(model, opt.step).layers["0"]
    assert update.imbalance <= 2.0 * (1 + 1e-6), (fmt, update.cores)


@pytest.mark.parametrize("fmt", ["tt", "ttm", "tucker", "tr", "btt"])
def test_a_converted_layer_moves_its_cores_alike_where_plain_does_not(fmt):
    """A decomposition leaves every core orthonormal but the one holding the singular values:
    with the plain parametrization Adam then moves the small cores several times faster
    (relative to their size) than the large one; the balanced layer spreads the gauge."""
    def step(parametrization: str):
        torch.manual_seed(0)
        linear = nn.Linear(256, 256).double()
        model = nn.Sequential(comera.GatedLinear.from_linear(linear, fmt, ranks=8,
                                                             parametrization=parametrization))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        model(torch.randn(32, 256, dtype=F64)).square().sum().backward()
        return relative_updates(model, opt.step).layers["0"]

    assert step("balanced").imbalance <= 2.0 * (1 + 1e-6) < 3.0 < step("plain").imbalance


@pytest.mark.parametrize("fmt", [f for f in FORMATS if get_format(f).exact_decomposition])
def test_full_rank_conversion_is_exact_and_bit_identical_to_the_plain_one(fmt):
    torch.manual_seed(1)
    linear = nn.Linear(24, 36).double()
    kw = {"ranks": 10_000, "in_modes": (2, 3, 4), "out_modes": (3, 3, 4)}
    if not get_format(fmt).uses_modes:
        kw = {"ranks": 10_000}
    with pytest.warns(comera.formats.bond_ranks.FullRankWarning):
        balanced = comera.GatedLinear.from_linear(linear, fmt, **kw)
    with pytest.warns(comera.formats.bond_ranks.FullRankWarning):
        plain = comera.GatedLinear.from_linear(linear, fmt, parametrization="plain", **kw)
    torch.testing.assert_close(balanced.to_dense(), linear.weight, rtol=1e-12, atol=1e-12)
    assert torch.equal(balanced.to_dense(), plain.to_dense())  # the gauge moved by powers of 2


def test_balance_gauge_keeps_the_weight_exactly_and_evens_the_cores():
    layout = get_format("tt").layout((2, 3, 4), (3, 3, 4), 4)
    scaling = core_scaling(layout)
    torch.manual_seed(2)
    cores = orthogonal_cores(layout, scaling, dtype=F64)
    cores[-1] = cores[-1] * 64.0  # all the scale on one core, as a decomposition leaves it
    spread = balance_gauge(cores, scaling.multipliers)
    assert torch.equal(layout.dense(spread), layout.dense(cores))
    ratios = [float(c.pow(2).mean().sqrt()) / m for c, m in zip(spread, scaling.multipliers,
                                                                 strict=True)]
    assert max(ratios) / min(ratios) <= 2.0 + 1e-9


def test_a_plain_state_dict_loads_into_a_balanced_layer_exactly():
    """Checkpoints stay compatible: a state dict of plain cores (as every layer saved before
    the parametrizations) carries no core_scales; the balanced layer takes scales of one."""
    torch.manual_seed(3)
    plain = _layer("tt", "plain", dtype=F64)
    assert "core_scales" not in plain.state_dict()
    balanced = _layer("tt", dtype=F64)
    assert "core_scales" in balanced.state_dict()
    balanced.load_state_dict(plain.state_dict())
    x = torch.randn(5, 24, dtype=F64)
    assert torch.equal(balanced(x), plain(x))
    assert balanced.parametrization == "plain" and "core_scales" not in balanced.state_dict()


def test_a_balanced_checkpoint_round_trips(tmp_path):
    torch.manual_seed(4)
    model = nn.Sequential(_layer("ttm", dtype=F64), nn.GELU(), _layer("lowrank", dtype=F64,
                                                                      ranks=3))
    model[2] = comera.GatedLinear(36, 24, "lowrank", ranks=3, dtype=F64)
    comera.save_checkpoint(tmp_path / "m.pt", model)
    torch.manual_seed(5)
    again = nn.Sequential(_layer("ttm", dtype=F64), nn.GELU(),
                          comera.GatedLinear(36, 24, "lowrank", ranks=3, dtype=F64))
    comera.load_checkpoint(tmp_path / "m.pt", again)
    x = torch.randn(4, 24, dtype=F64)
    assert torch.equal(again(x), model(x))
    assert again[0].core_scale_values == model[0].core_scale_values


def test_damaged_scales_are_refused():
    layer = _layer("tt")
    state = layer.state_dict()
    state["core_scales"] = torch.zeros_like(state["core_scales"])
    with pytest.raises(comera.ConfigError, match="core_scales"):
        layer.load_state_dict(state)


def test_unknown_parametrization_is_a_config_error():
    with pytest.raises(comera.ConfigError, match="parametrization='mup'"):
        _layer("tt", "mup")


def test_a_plain_layer_takes_a_balanced_state_dict_and_its_parametrization():
    torch.manual_seed(0)
    balanced = _layer("tt", dtype=F64)
    plain = _layer("tt", "plain", dtype=F64)
    plain.load_state_dict(balanced.state_dict())
    assert plain.parametrization == "balanced"
    assert plain.core_scale_values == balanced.core_scale_values
    torch.testing.assert_close(plain.to_dense(), balanced.to_dense(), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["btt", "ttm", "tt", "lowrank"])
def test_structure_aware_multipliers_give_each_core_the_mup_relative_update(fmt):
    """Adam's first step moves every stored entry by lr, so core k's relative update is
    lr * multiplier_k / std_k; against the dense layer's (lr * sqrt(3 in), nn.Linear's std) it
    must be what Qiu et al.'s rule gives against theirs (lr * sqrt(in), muP's std): rate
    in / (n fan_in_k) at std min(1, sqrt(fan_out_k / fan_in_k)) / sqrt(fan_in_k)."""
    from comera.formats.scaling import structure_aware_multipliers

    layout = _layer(fmt).layout
    scaling = core_scaling(layout)
    fans = layout.core_fans()
    n, n_in = len(fans), layout.in_features
    for m, std, (fi, fo) in zip(structure_aware_multipliers(layout), scaling.stds, fans,
                                strict=True):
        ours = (m / std) / math.sqrt(3 * n_in)
        theirs = (n_in / (n * fi)) / (min(1.0, math.sqrt(fo / fi)) / math.sqrt(fi)) / math.sqrt(
            n_in)
        assert ours == pytest.approx(theirs, rel=1e-12)
    # and against balanced, a per-core factor: larger where the core's fan-in is small
    ratios = [a / b for a, b in zip(structure_aware_multipliers(layout), scaling.multipliers,
                                    strict=True)]
    assert all(r > 1 for r in ratios)
