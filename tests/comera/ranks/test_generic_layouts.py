"""The rank machinery on a non-chain layout (the toy format: a hyperedge bond on every core, a
ring-like link between the first and last core, a fixed link): sizes, soft size, regularisers,
saliency pruning, truncation with Adam state, rounding and allocation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import comera
from comera import ConfigError, GatedLinear, TTLinear
from comera.formats.layout import Layout
from comera.ranks import objective
from comera.ranks.allocate import allocate, bond_spectra
from comera.ranks.truncate import excess_bonds, live_cores, round_, round_layer_
from comera.training.capture import _tensor_size
from tests.comera.layers.toy_formats import TOY

F64 = torch.float64


def _toy(ranks=(3, 2, 3), seed=0) -> GatedLinear:
    torch.manual_seed(seed)
    return GatedLinear(6, 6, TOY, ranks=ranks, in_modes=(2, 3), out_modes=(2, 3), dtype=F64)


def _model(seed=0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(_toy(seed=seed), nn.Tanh(), TTLinear(6, 6, (2, 3), (3, 2), ranks=3,
                                                              dtype=F64))


def _gates_01_(layer, zeros):
    with torch.no_grad():
        for gate in layer.gates:
            gate.fill_(1.0)
        for k, i in zeros:
            layer.gates[k][i] = 0.0


def test_soft_size_is_the_parameter_count_when_gates_are_zero_or_one():
    layer = _toy()
    _gates_01_(layer, [(0, 1), (2, 0), (2, 2)])
    model = nn.Sequential(layer)
    assert float(objective.soft_size(model).detach()) == layer.num_parameters() - layer.bias.numel()
    assert layer.num_parameters() - 6 == layer.layout.parameters_at((2, 2, 1))
    assert float(_tensor_size(model, 6)) == comera.model_size(model)


def test_soft_size_moves_with_every_carrier_of_a_bond():
    layer = _toy()
    model = nn.Sequential(layer)
    soft = objective.soft_size(model)
    (grad,) = torch.autograd.grad(soft, [layer.gates[0]])
    # d soft / d |a| = the slice cost of the hyperedge a, summed over its three cores
    costs = layer.layout.slice_costs(layer.bond_ranks)
    torch.testing.assert_close(grad, torch.full((3,), float(costs[0]), dtype=F64))


def test_slice_costs_and_the_size_weighted_regulariser():
    layer = _toy()
    layout = layer.layout
    # i1 o1 f = 2, i2 o2 = 3; a: A (c i1 f) + B (i2 o2 e) + C (e f o1 c);
    # e: B (i2 a o2) + C (f o1 a c); c: A (i1 a f) + C (e f o1 a)
    assert layout.slice_costs((3, 2, 3)) == (3 * 2 * 2 + 3 * 3 * 2 + 2 * 2 * 2 * 3,
                                             3 * 3 * 3 + 2 * 2 * 3 * 3,
                                             2 * 3 * 2 + 2 * 2 * 2 * 3)
    reg = objective.rank_regularizer(nn.Sequential(layer), "size_weighted")
    costs = layout.slice_costs((3, 2, 3))
    gates = [float(g.detach().abs().sum()) for g in layer.gates]
    expected = sum(c * g for c, g in zip(costs, gates, strict=True))
    expected /= sum(c * g.numel() for c, g in zip(costs, layer.gates, strict=True))
    assert float(reg) == pytest.approx(expected, rel=1e-12)


def test_saliency_multiplies_the_slice_norms_of_every_carrier():
    layer = _toy()
    with torch.no_grad():
        layer.gates[0].copy_(torch.tensor([0.5, -2.0, 1.0], dtype=F64))
    a, b, c = (core.detach() for core in layer.effective_cores())
    want = (layer.gates[0].detach().abs() * a.movedim(2, 0).reshape(3, -1).norm(dim=1)
            * b.movedim(1, 0).reshape(3, -1).norm(dim=1)
            * c.movedim(3, 0).reshape(3, -1).norm(dim=1))
    torch.testing.assert_close(objective._saliency(layer, 0), want)


def test_prune_to_lands_under_the_limit_and_keeps_the_layer_consistent():
    model = _model()
    start = comera.model_size(model)
    limit = start - 60
    pruned = objective.prune_to_(model, limit, rounding=True)
    assert pruned and comera.model_size(model) <= limit
    toy = model[0]
    assert toy.num_parameters() == toy.layout.parameters_at(toy.bond_ranks) + 6
    x = torch.randn(4, 6, dtype=F64)
    torch.testing.assert_close(toy(x), x @ toy.layout.dense(toy.gated_cores()) + toy.bias)


def test_truncate_keeps_the_function_and_slices_adam_state_in_every_carrier():
    model = _model()
    toy = model[0]
    with torch.no_grad():
        for gate in toy.gates:
            gate.uniform_(0.5, 1.5)
        toy.gates[0][1] = 0.0  # hyperedge a: three carriers
        toy.gates[2][2] = 0.1 * toy.tau  # ring link c: first and last core
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(5, 6, dtype=F64)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    with torch.no_grad():
        toy.gates[0][1] = 0.0  # Adam moved it; keep it pruned
        y = model(x)
    keep = {k: m.nonzero().flatten() for k, m in enumerate(toy.gate_masks())}
    old = [(p, {key: v.clone() for key, v in opt.state[p].items()}) for p in toy.cores]
    report = comera.truncate_(model, opt)
    assert dict((n, after) for n, _, after in report.layers)["0"] == (2, 2, 2)
    assert toy.bond_sizes == (2, 2, 2) and toy.layout.core_shapes == tuple(
        tuple(c.shape) for c in toy.cores)
    with torch.no_grad():
        torch.testing.assert_close(model(x), y, rtol=1e-12, atol=1e-12)
    for c, (_, state) in enumerate(old):
        new = toy.cores[c]
        assert new in opt.state and any(new is p for p in opt.param_groups[0]["params"])
        for key in ("exp_avg", "exp_avg_sq"):
            want = state[key]
            for k, bond in enumerate(toy.layout.bonds):
                for core, axis in toy.layout.carriers(bond):
                    if core == c:
                        want = want.index_select(axis, keep[k])
            torch.testing.assert_close(opt.state[new][key], want, rtol=0, atol=0)
    assert all(bool((g == 1).all()) for g in toy.gates)  # folded into their first carrier


def test_live_cores_are_the_same_weight_at_the_effective_ranks():
    layer = _toy()
    with torch.no_grad():
        layer.gates[1].copy_(torch.tensor([0.0, 1.7], dtype=F64))
        layer.gates[2].copy_(torch.tensor([-0.3, 0.0, 2.0], dtype=F64))
    cores = live_cores(layer)
    live = layer.layout.resized({"e": 1, "c": 2})
    assert tuple(tuple(c.shape) for c in cores) == live.core_shapes
    torch.testing.assert_close(live.dense(cores), layer.layout.dense(layer.gated_cores()))


def test_a_format_without_rounding_is_left_as_it_is_and_refuses_spectrum_allocation():
    layer = _toy(ranks=(3, 2, 3))
    model = _model()
    assert not round_layer_(layer)
    before = [c.clone() for c in model[0].cores]
    report = round_(model, only_excess=False)
    assert all(torch.equal(a, b) for a, b in zip(before, model[0].cores, strict=True))
    assert report.layers[0][1] == report.layers[0][2]
    with pytest.raises(ConfigError, match='allocation="prune"'):
        allocate(model, 0.5 * comera.model_size(model))
    with pytest.raises(ConfigError, match="'toy' format"):
        bond_spectra(layer)
    assert objective.rounded_ranks(layer) == layer.ranks


def test_excess_bonds_are_read_from_the_two_carriers_of_a_bond():
    layout = Layout(("i",), ("o",), (("i", "r"), ("r", "o")), (("i", 2), ("o", 3), ("r", 5)),
                    ("r",))
    assert layout.bond_caps((5,)) == (2,)
    assert layout.slice_costs((5,)) == (5,)
    toy = _toy()  # the hyperedge a has no cap; e and c are capped by their two cores
    assert toy.layout.bond_caps((3, 2, 3))[0] is None
    assert excess_bonds(toy) == []
    big = _toy(ranks=(1, 1, 13))  # c > min(A's 2*1*2, C's 1*2*2*1)
    assert excess_bonds(big) == [2]


def test_floor_size_counts_every_bond_at_min_rank():
    model = _model()
    toy, tt = model[0], model[2]
    other = comera.model_size(model) - toy.num_parameters() - tt.num_parameters()
    want = (toy.layout.parameters_at((1, 1, 1)) + 6 + tt.layout.parameters_at((1, 1, 1)) + 6
            + other)
    assert objective.floor_size(model, 1) == want


def test_a_non_chain_format_with_an_exact_rounding_rounds_in_place():
    from tests.comera.layers.toy_formats import TWO

    torch.manual_seed(0)
    layer = GatedLinear(3, 4, TWO, ranks=5, dtype=F64)
    assert layer.bonds == (5,) and layer.ranks == (5,)  # not a chain: no ends
    assert excess_bonds(layer) == [0]  # r = 5 > min(3, 4)
    assert objective.rounded_ranks(layer) == (3,)
    x = torch.randn(2, 3, dtype=F64)
    opt = torch.optim.Adam(layer.parameters())
    layer(x).sum().backward()
    opt.step()
    with torch.no_grad():
        y = layer(x)
        assert round_layer_(layer, opt)
        torch.testing.assert_close(layer(x), y, rtol=1e-10, atol=1e-12)
    assert layer.bond_ranks == (3,) and layer.gates[0].tolist() == [1, 1, 1, 0, 0]
    assert float(opt.state[layer.cores[0]]["exp_avg"].abs().sum()) == 0.0
    comera.truncate_(layer)
    assert layer.bond_sizes == (3,)
    torch.testing.assert_close(layer(x), y, rtol=1e-10, atol=1e-12)


def test_from_linear_by_a_format_decomposition_shrinks_the_bond_to_what_it_found():
    from tests.comera.layers.toy_formats import TWO

    torch.manual_seed(0)
    linear = nn.Linear(3, 4, dtype=F64)
    layer = GatedLinear.from_linear(linear, TWO, ranks=8)
    assert layer.bond_sizes == (3,) and layer.gates[0].numel() == 3
    torch.testing.assert_close(layer.to_dense(), linear.weight, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer.bias, linear.bias)
    with pytest.raises(ConfigError, match="uses no modes"):
        GatedLinear(3, 4, TWO, in_modes=(3,))
