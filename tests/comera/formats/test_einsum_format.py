"""Einsum-declared layouts (comera.formats.einsum): parsing, sizes, checks, the format."""

from __future__ import annotations

import re

import pytest
import torch

import tncomp
from comera.errors import ConfigError
from comera.formats.einsum import Declared, layout_from_eq
from comera.formats.layout import Layout
from comera.formats.registry import get_format
from comera.layers.linear import GatedLinear
from tests.comera.formats.layout_checks import check_network, random_cores

EQ = "b i j, i a, a j k -> b k"
SIZES = {"i": 2, "j": 3, "k": 4}


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_the_example_reads_as_x_cores_and_y():
    layout = layout_from_eq(EQ, "a", SIZES, ranks=2)
    assert layout.inputs == ("i", "j") and layout.outputs == ("k",)
    assert layout.cores == (("i", "a"), ("a", "j", "k"))
    assert layout.bonds == ("a",)
    assert dict(layout.sizes) == {"i": 2, "j": 3, "k": 4, "a": 2}
    assert layout.carriers("a") == ((0, 1), (1, 0))


def test_spaces_are_optional():
    assert layout_from_eq("bij,ia,ajk->bk", "a", SIZES, 2) == layout_from_eq(EQ, "a", SIZES, 2)


@pytest.mark.parametrize("eq, bonds, sizes, ranks", [
    (EQ, "a", SIZES, 2),
    ("n i j, i j a, a j k -> n k", "a", SIZES, 3),  # j on x and two cores: a hyperedge
    ("b i j, i r, j r, r k -> b k", "r", SIZES, 2),  # a CP-like bond on three cores
    ("b i j, i a c, a j, c k -> b k", "a c", SIZES, {"a": 2, "c": 3}),
    ("b i, i a, a c, c k l -> b l k", ["a", "c"], {"i": 4, "k": 2, "l": 3}, 2),
])
def test_network_matches_dense_and_the_users_einsum(eq, bonds, sizes, ranks):
    gen = _gen(1)
    layout = layout_from_eq(eq, bonds, sizes, ranks)
    check_network(get_format("einsum"), layout, gen)
    cores = random_cores(layout, gen)
    x = torch.randn(3, *layout.in_modes, generator=gen, dtype=torch.float64)
    compiled = tncomp.compile(Declared().network(layout), disk_cache=False)
    torch.testing.assert_close(compiled(x, *cores), torch.einsum(eq, x, *cores),
                               rtol=1e-12, atol=1e-12)


def test_parameter_count():
    layout = layout_from_eq(EQ, "a", SIZES, 5)
    assert layout.parameters_at((5,)) == 2 * 5 + 5 * 3 * 4
    assert layout.parameters_at((1,)) == 2 + 12


def test_ranks_int_mapping_and_sizes():
    eq = "b i j, i a c, a j, c k -> b k"
    assert layout_from_eq(eq, "a c", SIZES, 2).bond_sizes == (2, 2)
    assert layout_from_eq(eq, "ac", SIZES, {"a": 2, "c": 1}).bond_sizes == (2, 1)
    assert layout_from_eq(eq, "a c", {**SIZES, "a": 2, "c": 3}).bond_sizes == (2, 3)
    # a bond in sizes keeps its size under an int ranks; the others take the int
    assert layout_from_eq(eq, "a c", {**SIZES, "c": 1}, 2).bond_sizes == (2, 1)
    assert layout_from_eq(eq, "a c", {**SIZES, "c": 1}, {"c": 1, "a": 2}).bond_sizes == (2, 1)


def test_an_int_rank_is_capped_at_what_a_core_can_hold():
    # a joins core (i, a) and core (a, j, k): beyond i = 2 the first core has no more rank
    assert layout_from_eq(EQ, "a", SIZES, 100).bond_sizes == (2,)
    # an explicit size up to the cap is taken as given
    assert layout_from_eq(EQ, "a", SIZES, {"a": 2}).bond_sizes == (2,)
    # a bond on three cores is capped only at the dense weight's entries (6 x 4)
    assert layout_from_eq("b i j, i r, j r, r k -> b k", "r", SIZES, 20).bond_sizes == (20,)
    assert layout_from_eq("b i j, i r, j r, r k -> b k", "r", SIZES, 10**6).bond_sizes == (24,)


@pytest.mark.parametrize(("bonds", "sizes", "ranks", "said"), [
    ("a", SIZES, {"a": 2**33}, "ranks['a']=8589934592 is above 2"),
    ("a", SIZES, {"a": 3}, "ranks['a']=3 is above 2"),
    ("a", {**SIZES, "a": 2**40}, None, "sizes['a']=1099511627776 is above 2"),
    ("r", SIZES, {"r": 2**33}, "ranks['r']=8589934592 is above 24"),
])
def test_a_bond_size_above_its_cap_is_refused_before_any_allocation(bonds, sizes, ranks, said):
    """Issue 34, item 10: a per-bond size is bounded as an int rank is (which is capped),
    so ``from_eq(..., ranks={"a": 2**33})`` never reaches the allocator."""
    eq = EQ if bonds == "a" else "b i j, i r, j r, r k -> b k"
    with pytest.raises(ConfigError, match=re.escape(said)):
        layout_from_eq(eq, bonds, sizes, ranks)
    with pytest.raises(ConfigError, match=re.escape(said)):
        GatedLinear.from_eq(eq, bonds, sizes, ranks)


def test_a_layout_record_rebuilds_the_same_network():
    layout = layout_from_eq("b i j, i j a, a j k -> b k", "a", SIZES, 3)
    again = Layout.from_dict(layout.to_dict())
    assert again == layout
    fmt = get_format("einsum")
    assert fmt.network(again) == fmt.network(layout)


@pytest.mark.parametrize("eq, bonds, sizes, ranks, match", [
    (3, "a", SIZES, 2, "eq=3"),
    ("b i j, i a, a j k", "a", SIZES, 2, "'->'"),
    ("b i j -> b i j -> b k", "a", SIZES, 2, "'->'"),
    ("b i1, i a -> b a", "a", SIZES, 2, "'b i1'"),
    ("b ... i, i k -> b k", "", SIZES, 2, r"'b \.\.\. i'"),
    ("b i i, i k -> b k", "", SIZES, 2, "'i' appears twice"),
    ("b i j -> b i", "", SIZES, 2, "no core"),
    (", i a, a k -> k", "a", SIZES, 2, "no index"),
    ("b i j, i a, a j k -> k b", "a", SIZES, 2, "start with the batch index 'b'"),
    ("b i j, i a, a j k -> ", "a", SIZES, 2, "start with the batch"),
    ("b i j, , i a, a j k -> b k", "a", SIZES, 2, r"core 1 \(operand 2\)"),
    ("b i j, i a b, a j k -> b k", "a", SIZES, 2, "batch index 'b'"),
    ("b i j, i a, a j k -> b k l", "a", SIZES, 2, "'l' of y is on no core"),
    ("b i j q, i a, a j k -> b k", "a", SIZES, 2, "'q' of x is on no core"),
    ("b i j, i a k, a j k -> b k i", "a", SIZES, 2, "'i' is on x and on y"),
    ("b i j, i a q, a j k -> b k", "a", SIZES, 2, "'q' is on one core only"),
    ("b i j, i a, a j k -> b k", "c", SIZES, 2, "bond 'c' is on no core"),
    ("b i j, i a, a j k -> b k", "k", SIZES, 2, "bond 'k' is on x or y"),
    ("b i j, i a, a j k -> b k", "i", SIZES, 2, "bond 'i' is on x or y"),
    ("b i j, i a, a j k -> b k", "aa", SIZES, 2, "twice"),
    ("b i j, i a, a j k -> b k", 5, SIZES, 2, "bonds=5"),
    ("b i j, i a, a j k -> b k", ["ab"], SIZES, 2, "'ab'"),
    (EQ, "a", {"i": 2, "j": 3}, 2, r"no entry for \['k'\]"),
    (EQ, "a", {**SIZES, "q": 2}, 2, r"\['q'\]"),
    (EQ, "a", {**SIZES, "b": 8}, 2, "batch index 'b'"),
    (EQ, "a", {**SIZES, "i": 0}, 2, r"sizes\['i'\]=0"),
    (EQ, "a", {**SIZES, "j": 2.0}, 2, r"sizes\['j'\]=2.0"),
    (EQ, "a", [("i", 2)], 2, "sizes="),
    (EQ, "a", SIZES, 0, "ranks=0"),
    (EQ, "a", SIZES, True, "ranks=True"),
    (EQ, "a", SIZES, (2,), r"ranks=\(2,\)"),
    (EQ, "a", SIZES, {"a": -1}, r"ranks\['a'\]=-1"),
    (EQ, "a", SIZES, {"c": 2}, r"ranks names \['c'\]"),
    (EQ, "a", SIZES, None, "bond 'a' has no size"),
    (EQ, "a", {**SIZES, "a": 3}, {"a": 2}, "size 3 in sizes and 2 in ranks"),
])
def test_bad_declarations_raise_config_error_naming_the_value(eq, bonds, sizes, ranks, match):
    with pytest.raises(ConfigError, match=match):
        layout_from_eq(eq, bonds, sizes, ranks)


def test_the_format_is_registered_and_points_to_from_eq():
    fmt = get_format("einsum")
    assert isinstance(fmt, Declared) and fmt.name == "einsum"
    with pytest.raises(ConfigError, match="from_eq"):
        fmt.layout((4,), (4,), 2)
    layout = layout_from_eq(EQ, "a", SIZES, 2)
    assert fmt.decompose(torch.zeros(6, 4, dtype=torch.float64), layout) is None
    assert fmt.round(random_cores(layout, _gen()), layout) is None
    assert not fmt.exact_decomposition


# -- the layer ----------------------------------------------------------------------------------
def test_a_declared_layer_equals_its_dense_reconstruction():
    from comera.layers.linear import GatedLinear
    from tests.comera.formats.layout_checks import check_layer

    torch.manual_seed(0)
    # what GatedLinear.from_eq("b i j, i j a, a j c, c k -> b k", "a c", sizes, ranks) builds
    layout = layout_from_eq("b i j, i j a, a j c, c k -> b k", "a c", SIZES, {"a": 3, "c": 2})
    layer = GatedLinear.from_layout(layout, "einsum", dtype=torch.float64)
    assert layer.format.name == "einsum" and layer.bond_sizes == (3, 2)
    assert (layer.in_features, layer.out_features) == (6, 4)
    check_layer(layer, _gen(10))
    again = GatedLinear.from_layout(Layout.from_dict(layer.layout.to_dict()), "einsum",
                                    dtype=torch.float64)
    assert again.layout == layer.layout


def test_a_declared_layer_from_linear_keeps_its_random_cores_and_the_bias():
    from torch import nn

    from comera.layers.linear import GatedLinear

    layer = GatedLinear.from_layout(layout_from_eq(EQ, "a", SIZES, 2), "einsum",
                                    dtype=torch.float64)
    linear = nn.Linear(6, 4, dtype=torch.float64)
    before = [c.detach().clone() for c in layer.cores]
    assert layer.load_weight_(linear.weight.detach().T, linear.bias) is False
    assert all(torch.equal(a, b) for a, b in zip(before, layer.cores, strict=True))
    torch.testing.assert_close(layer.bias.detach(), linear.bias.detach())


def _declared_layer():
    from comera.layers.linear import GatedLinear

    torch.manual_seed(1)
    # not a chain: bond a leads its first carrier, c closes on the first core and trails k
    layout = layout_from_eq("b i j, a c i, j a, k c j -> b k", "a c", SIZES, {"a": 3, "c": 3})
    assert not layout.is_chain
    return GatedLinear.from_layout(layout, "einsum", dtype=torch.float64)


def test_pruning_a_declared_bond_cuts_it_from_its_carriers():
    from tests.comera.formats.layout_checks import check_pruned_slices_leave

    check_pruned_slices_leave(_declared_layer(), {0: [1], 1: [0, 2]}, _gen(11))


def test_truncating_a_declared_bond_keeps_the_function_and_adam_state():
    from tests.comera.formats.layout_checks import check_truncate

    check_truncate(_declared_layer(), {0: [2], 1: [0]}, _gen(12))


def test_gated_linear_by_name_points_to_from_eq():
    from comera.layers.linear import GatedLinear

    with pytest.raises(ConfigError, match="from_eq"):
        GatedLinear(6, 4, "einsum")


def test_an_index_named_b_need_not_be_the_batch():
    """The network names its batch with a free label, so a feature or bond may be called b."""
    layout = layout_from_eq("n i b, i b a, a k -> n k", "a", {"i": 2, "b": 3, "k": 4}, 2)
    cores = [torch.randn(s, dtype=torch.float64) for s in layout.core_shapes]
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    y = tncomp.compile(layout.network())(x, *cores)
    torch.testing.assert_close(y, torch.einsum("nib,iba,ak->nk", x, *cores))
