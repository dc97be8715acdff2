"""GatedLinear on any layout: the toy non-chain format (a hyperedge bond, a ring-like link, a
fixed internal link) against its dense reconstruction, gates, sizes and the constructors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import comera
from comera import ConfigError, GatedLinear, TTLinear, TTMLinear
from comera.formats.layout import Layout
from tests.comera.layers.toy_formats import TOY

F64 = torch.float64


def _toy(ranks=(3, 2, 3), bias=True, seed=0) -> GatedLinear:
    torch.manual_seed(seed)
    return GatedLinear(6, 6, TOY, ranks=ranks, in_modes=(2, 3), out_modes=(2, 3), bias=bias,
                       dtype=F64)


def _dense_out(layer: GatedLinear, x):
    w = layer.layout.dense(layer.gated_cores())  # (in, out)
    y = x @ w
    return y + layer.bias if layer.bias is not None else y


def test_the_toy_layout_has_a_hyperedge_a_ring_link_and_a_fixed_link():
    layout = _toy().layout
    assert layout.carriers("a") == ((0, 2), (1, 1), (2, 3))  # on every core
    assert layout.carriers("c") == ((0, 0), (2, 4))  # first and last core
    assert "f" in layout.internal and "f" not in layout.bonds
    assert not layout.is_chain


def test_forward_and_gradients_equal_the_dense_reconstruction():
    layer = _toy()
    with torch.no_grad():
        for gate in layer.gates:
            gate.uniform_(0.5, 1.5)
        layer.gates[0][1] = 0.0  # a pruned slice of the hyperedge
        layer.bias.normal_()
    x = torch.randn(5, 6, dtype=F64)
    y = layer(x)
    torch.testing.assert_close(y, _dense_out(layer, x), rtol=1e-12, atol=1e-12)
    t = torch.randn_like(y)
    got = torch.autograd.grad((y * t).sum(), [*layer.cores, *layer.gates])
    want = torch.autograd.grad((_dense_out(layer, x) * t).sum(), [*layer.cores, *layer.gates])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_gradcheck_through_cores_gates_and_input():
    layer = _toy(ranks=(2, 2, 2))
    x = torch.randn(3, 6, dtype=F64, requires_grad=True)
    params = [*layer.cores, *layer.gates]

    def f(x, *ps):
        return torch.func.functional_call(
            layer, {f"cores.{k}": ps[k] for k in range(3)}
            | {f"gates.{k}": ps[3 + k] for k in range(3)}, (x,))

    inputs = (x, *(p.detach().clone().requires_grad_() for p in params))
    assert torch.autograd.gradcheck(f, inputs)


def test_a_gate_at_or_below_tau_removes_its_slice_from_every_carrier():
    layer = _toy()
    x = torch.randn(4, 6, dtype=F64)
    with torch.no_grad():
        layer.gates[0][2] = 0.5 * layer.tau  # hyperedge a, slice 2
        layer.gates[2][0] = -0.5 * layer.tau  # ring link c, slice 0
        y = layer(x)
        cores = [c.clone() for c in layer.effective_cores()]
        cores[0][:, :, 2] = 0  # dropping the slice from its first carrier zeroes every term
        cores[0][0] = 0
        layer.gates[0][2] = 1.0
        layer.gates[2][0] = 1.0
        want = x @ layer.layout.dense(cores) + layer.bias
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    assert layer.bond_ranks == (3, 2, 3)
    with torch.no_grad():
        layer.gates[1].zero_()
    assert layer.is_removed() and layer.num_parameters() == layer.bias.numel()
    torch.testing.assert_close(layer(x), layer.bias.expand(4, 6))


def test_num_parameters_follow_the_layout_at_the_effective_ranks():
    layer = _toy()
    assert layer.num_parameters(False) == sum(p.numel() for p in layer.parameters())
    assert layer.num_parameters() == layer.layout.parameters_at((3, 2, 3)) + 6
    with torch.no_grad():
        layer.gates[0][0] = 0.0
        layer.gates[2][1:] = 0.0
    assert layer.bond_ranks == (2, 2, 1) and layer.ranks == (2, 2, 1)
    assert layer.bonds == (3, 2, 3)
    assert layer.num_parameters() == layer.layout.parameters_at((2, 2, 1)) + 6
    assert layer.dense_num_parameters() == 6 * 6 + 6


def test_the_gaussian_init_targets_the_dense_variance():
    torch.manual_seed(0)
    layer = GatedLinear(36, 36, TOY, ranks=(4, 4, 4), in_modes=(6, 6), out_modes=(6, 6),
                        dtype=F64)
    w = layer.to_dense().detach()
    assert w.shape == (36, 36)
    assert 0.3 < float(w.var()) * (36 + 36) < 3.0


def test_from_layout_rebuilds_the_same_shapes_and_checks_the_format():
    layer = _toy()
    record = Layout.from_dict(layer.layout.to_dict())
    again = GatedLinear.from_layout(record, TOY, dtype=F64)
    assert [c.shape for c in again.cores] == [c.shape for c in layer.cores]
    assert again.layout == layer.layout and again.format is TOY
    tt = TTLinear(12, 20, (3, 4), (4, 5), ranks=3)
    rebuilt = TTLinear.from_layout(tt.layout, "tt")
    assert type(rebuilt) is TTLinear and rebuilt.bonds == tt.bonds
    with pytest.raises(ConfigError, match="TTLinear is the 'tt' format"):
        TTLinear.from_layout(tt.layout, "ttm")


def test_gated_linear_at_tt_and_ttm_is_the_tt_layers_bit_for_bit():
    for cls, name in ((TTLinear, "tt"), (TTMLinear, "ttm")):
        torch.manual_seed(3)
        old = cls(12, 20, (3, 4), (4, 5), ranks=3)
        torch.manual_seed(3)
        new = GatedLinear(12, 20, name, ranks=3, in_modes=(3, 4), out_modes=(4, 5))
        assert new.layout == old.layout and new.bonds == old.bonds
        x = torch.randn(4, 12)
        assert torch.equal(old(x), new(x))
        torch.testing.assert_close(new.to_dense(), old.to_dense())


def test_from_linear_is_exact_at_full_rank_and_shrinks_to_what_it_found():
    torch.manual_seed(0)
    linear = nn.Linear(12, 20, dtype=F64)
    for fmt in ("tt", "ttm"):
        layer = GatedLinear.from_linear(linear, fmt, ranks=64, in_modes=(3, 4),
                                        out_modes=(4, 5))
        torch.testing.assert_close(layer.to_dense(), linear.weight, rtol=1e-10, atol=1e-12)
        assert layer.layout.core_shapes == tuple(tuple(c.shape) for c in layer.cores)
        assert [g.numel() for g in layer.gates] == list(layer.bond_sizes)
    toy = GatedLinear.from_linear(nn.Linear(6, 6, dtype=F64), TOY, ranks=2, in_modes=(2, 3),
                                  out_modes=(2, 3))  # no decomposition: random cores, bias kept
    assert toy.bond_sizes == (2, 2, 2)


def test_bad_requests_are_config_errors_naming_the_fix():
    with pytest.raises(ConfigError, match="format='nope'"):
        GatedLinear(12, 20, "nope")
    with pytest.raises(ConfigError, match="differ in length"):
        GatedLinear(12, 20, "ttm", in_modes=(3, 4), out_modes=(20,))
    with pytest.raises(ConfigError, match="differ in length"):
        TTLinear(12, 20, (3, 4), (20,))
    with pytest.raises(ConfigError, match=r"from_linear takes an nn\.Linear"):
        GatedLinear.from_linear(nn.Conv1d(2, 2, 1))


def test_resize_bonds_follows_into_the_layout_and_plan():
    layer = _toy()
    layer.resize_bonds_((2, 1, 3))
    assert layer.bond_sizes == (2, 1, 3)
    assert [g.numel() for g in layer.gates] == [2, 1, 3]
    x = torch.randn(2, 6, dtype=F64)
    torch.testing.assert_close(layer(x), _dense_out(layer, x))
    assert layer.compiled() is layer._compiled and "cores" in repr(layer)


def test_gated_linear_is_exported():
    assert comera.GatedLinear is GatedLinear and "GatedLinear" in comera.__all__


def test_siblings_of_a_non_chain_format_stack_with_padded_bonds():
    from comera.layers.siblings import Siblings, stack_key

    torch.manual_seed(0)
    layers = [_toy(ranks=r, seed=i) for i, r in enumerate([(3, 2, 3), (2, 2, 3), (3, 1, 2)])]
    assert stack_key(layers) is not None
    x = torch.randn(4, 6, dtype=F64)
    stacked = Siblings()(layers, x)
    for layer, y in zip(layers, stacked, strict=True):
        torch.testing.assert_close(y, layer(x), rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(sum(y.sum() for y in stacked), [layers[2].cores[2]])
    want = torch.autograd.grad(layers[2](x).sum(), [layers[2].cores[2]])
    torch.testing.assert_close(grads[0], want[0], rtol=1e-12, atol=1e-12)
    assert stack_key([layers[0], TTLinear(6, 6, (2, 3), (2, 3), ranks=2, dtype=F64)]) is None


def test_a_model_pickled_before_layouts_loads_and_computes_the_same():
    from pathlib import Path

    saved = torch.load(Path(__file__).parent / "data" / "legacy_tt_model.pt", weights_only=False)
    model = saved["model"]  # torch.save of TTLinear, TTMLinear, TTEmbedding at c57ff6a
    a, b, emb = model["a"], model["b"], model["emb"]
    assert (a.format.name, b.format.name, emb.format.name) == ("tt", "ttm", "ttm")
    assert a.layout.is_chain and a.ranks[1] == a.bonds[1] - 1
    assert emb.in_modes == emb.row_modes and a.in_modes == (2, 2, 3)
    with torch.no_grad():
        y = b(torch.tanh(a(saved["x"] + emb(saved["ids"]))))
    assert torch.equal(y, saved["y"])


def test_copies_keep_their_format_and_still_stack_with_the_originals():
    import copy
    import pickle

    from comera.layers.siblings import stack_key

    layer = _toy()
    for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert twin.format.name == "toy" and twin.layout == layer.layout
        x = torch.randn(2, 6, dtype=F64)
        torch.testing.assert_close(twin(x), layer(x), rtol=0, atol=0)
        assert stack_key([layer, twin]) is not None


def test_a_layer_built_fresh_is_tt_matrix_and_one_decomposed_is_tt():
    """The formats chosen by the measurements (issue 40): TT-matrix for layers trained from
    scratch, TT (CoMERA's) for decompositions of trained weights."""
    from comera.layers.linear import DECOMPOSED_FORMAT, FRESH_FORMAT

    assert (FRESH_FORMAT, DECOMPOSED_FORMAT) == ("ttm", "tt")
    torch.manual_seed(0)
    fresh = GatedLinear(64, 32, ranks=4)
    assert fresh.format.name == "ttm" and fresh.parametrization == "balanced"
    torch.manual_seed(0)
    same = GatedLinear(64, 32, "ttm", ranks=4)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                 same.state_dict().values(), strict=True))
    decomposed = GatedLinear.from_linear(nn.Linear(64, 32), ranks=4)
    assert decomposed.format.name == "tt" and decomposed.parametrization == "plain"
