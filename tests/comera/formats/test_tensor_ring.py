"""The tensor-ring format (comera.formats.tensor_ring): layout, network, TR-SVD, rounding."""

from __future__ import annotations

import math

import pytest
import torch

from comera.errors import ConfigError
from comera.formats.registry import get_format
from comera.formats.tensor_ring import TensorRing, ring_rank_cap, round_ring, tr_svd
from comera.formats.ttsvd import tt_rank_bounds
from tests.comera.formats.layout_checks import check_network, random_cores

TR = TensorRing()


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _at(layout, cores):
    """The layout at the bond sizes ``cores`` carry (bond k's size on core k's axis 0)."""
    return layout.resized({b: cores[k].shape[0] for k, b in enumerate(layout.bonds)})


def test_registered_under_tr():
    assert get_format("tr") is not None and get_format("tr").name == "tr"
    assert isinstance(get_format("tr"), TensorRing)


def test_layout_closes_the_ring_and_every_link_is_a_bond():
    layout = TR.layout((2, 3), (4, 5), (2, 3, 4, 5))
    assert layout.inputs == ("i1", "i2") and layout.outputs == ("o1", "o2")
    assert layout.cores == (("r0", "i1", "r1"), ("r1", "i2", "r2"), ("r2", "o1", "r3"),
                            ("r3", "o2", "r0"))
    assert layout.bonds == ("r0", "r1", "r2", "r3")
    assert layout.core_shapes == ((2, 2, 3), (3, 3, 4), (4, 4, 5), (5, 5, 2))
    assert layout.carriers("r0") == ((0, 0), (3, 2))  # the closing bond's gate sits on core 1
    assert layout.internal == ("r0", "r1", "r2", "r3")


def test_parameter_count():
    layout = TR.layout((4, 4), (4, 4), 3)
    assert sum(math.prod(s) for s in layout.core_shapes) == 4 * 3 * 4 * 3
    assert layout.parameters_at(layout.bond_sizes) == 4 * 3 * 4 * 3
    assert layout.parameters_at((1, 2, 2, 2)) == 1 * 4 * 2 + 2 * 4 * 2 * 2 + 2 * 4 * 1


def test_an_int_rank_is_capped_where_every_weight_is_a_ring():
    modes = (2, 3, 3, 2)
    assert ring_rank_cap(modes) == max(tt_rank_bounds(modes)) == 6
    assert TR.layout((2, 3), (3, 2), 100).bond_sizes == (6, 6, 6, 6)
    assert TR.layout((2, 3), (3, 2), 4).bond_sizes == (4, 4, 4, 4)


@pytest.mark.parametrize("ranks", [0, -2, True, 2.0, "4", (2, 2, 2), (2, 0, 2, 2),
                                   (2, 2, 2, 2.5)])
def test_bad_ranks_name_the_value(ranks):
    with pytest.raises(ConfigError, match="ranks"):
        TR.layout((2, 3), (3, 2), ranks)


@pytest.mark.parametrize("in_modes, out_modes, ranks", [
    ((2, 3), (3, 2), (2, 3, 2, 3)), ((3,), (4,), (2, 3)), ((2, 2, 2), (3,), 2)])
def test_network_matches_dense_and_einsum(in_modes, out_modes, ranks):
    check_network(TR, TR.layout(in_modes, out_modes, ranks), _gen())


@pytest.mark.parametrize("in_modes, out_modes", [((2, 3), (3, 2)), ((4,), (6,)),
                                                  ((2, 2, 3), (5,)), ((3, 2), (2, 2, 2))])
def test_tr_svd_at_full_rank_reproduces_the_weight(in_modes, out_modes):
    layout = TR.layout(in_modes, out_modes, 10_000)
    w = torch.randn(layout.in_features, layout.out_features, generator=_gen(1),
                    dtype=torch.float64)
    cores = TR.decompose(w, layout)
    assert all(c.shape[0] <= r for c, r in zip(cores, layout.bond_sizes, strict=True))
    torch.testing.assert_close(_at(layout, cores).dense(cores), w, rtol=0, atol=1e-12)


def test_tr_svd_recovers_a_tt_exactly_at_its_ranks():
    # a TT is a ring with r0 = 1: TR-SVD at those ranks finds it without error
    gen = _gen(2)
    tt = TR.layout((3, 4), (4, 3), (1, 2, 2, 2))
    w = tt.dense(random_cores(tt, gen))
    cores = TR.decompose(w, tt)
    assert [c.shape[0] for c in cores] == [1, 2, 2, 2]
    torch.testing.assert_close(tt.dense(cores), w, rtol=0, atol=1e-12)


def test_a_truncated_first_split_costs_exactly_the_dropped_singular_values():
    # r0 r1 = 4 < n1 = 6 while the rest is at full rank: the only error is the first SVD's tail
    w = torch.randn(6 * 2, 3 * 2, generator=_gen(3), dtype=torch.float64)
    layout = TR.layout((6, 2), (3, 2), (2, 2, 100, 100))
    cores = TR.decompose(w, layout)
    s = torch.linalg.svdvals(w.reshape(6, -1))
    err = torch.linalg.norm(_at(layout, cores).dense(cores) - w)
    torch.testing.assert_close(err, s[4:].norm(), rtol=1e-10, atol=1e-12)


def test_tr_svd_pads_a_split_that_does_not_factor():
    # 3 singular values read as r0' = 2 by r1' = 2 with one zero column: still exact
    w = torch.randn(3, 8, generator=_gen(4), dtype=torch.float64)
    cores = tr_svd(w, (2, 2))
    assert cores[0].shape == (2, 3, 2) and cores[1].shape == (2, 8, 2)
    torch.testing.assert_close(torch.einsum("aib,bja->ij", *cores), w, rtol=0, atol=1e-12)


def test_tr_svd_rejects_one_mode():
    with pytest.raises(ConfigError, match="2"):
        tr_svd(torch.randn(5, dtype=torch.float64), (1,))


def test_lower_ranks_lower_the_parameters_and_bound_the_error():
    w = torch.randn(24, 24, generator=_gen(5), dtype=torch.float64)
    errors = []
    for rank in (1, 2, 4, 6, 10_000):
        layout = TR.layout((4, 6), (6, 4), rank)
        cores = TR.decompose(w, layout)
        assert all(c.shape[0] <= max(rank, 1) for c in cores)
        errors.append(float(torch.linalg.norm(_at(layout, cores).dense(cores) - w)))
    assert all(e <= float(torch.linalg.norm(w)) for e in errors)
    assert errors[-1] < 1e-10 < errors[0]


def test_round_is_exact_and_drops_zero_padding():
    gen = _gen(6)
    small = TR.layout((2, 3), (3, 2), 2)
    cores = random_cores(small, gen)
    w = small.dense(cores)
    padded = [torch.nn.functional.pad(c, (0, 2, 0, 0, 0, 2)) for c in cores]  # every bond 4
    rounded = TR.round(padded, TR.layout((2, 3), (3, 2), 4))
    assert all(c.shape[0] <= 2 for c in rounded)
    torch.testing.assert_close(_at(small, rounded).dense(rounded), w, rtol=0, atol=1e-12)


def test_round_keeps_a_full_ring():
    layout = TR.layout((2, 2), (2, 2), 2)
    cores = random_cores(layout, _gen(7))
    rounded = round_ring(cores)
    assert [c.shape[0] for c in rounded] == [2, 2, 2, 2]
    torch.testing.assert_close(layout.dense(rounded), layout.dense(cores), rtol=0, atol=1e-12)


def test_layout_record_round_trips():
    from comera.formats.layout import Layout

    layout = TR.layout((2, 3), (3, 2), (2, 3, 2, 3))
    assert Layout.from_dict(layout.to_dict()) == layout


def test_the_first_split_keeps_the_largest_closing_bond_the_rest_can_carry():
    from comera.formats.tensor_ring import split_first

    # (2, 3, 3, 2) at the cap 6: two singular values, read as r0 = 2, r1 = 1 (a ring)
    assert split_first(2, (6, 6, 6, 6), (2, 3, 3, 2)) == (2, 1)
    # (2, 2, 3, 5) at the cap 5: r0 = 2 would need a bond of 6 later; r0 = 1 (the TT) fits
    assert split_first(2, (5, 5, 5, 5), (2, 2, 3, 5)) == (1, 2)
    # nothing fits at rank 1 everywhere: the layout's own r0
    assert split_first(1, (1, 1, 1, 1), (4, 4, 4, 4)) == (1, 1)


# -- the layer ----------------------------------------------------------------------------------
def test_gated_linear_ring_equals_its_dense_reconstruction():
    from comera.layers.linear import GatedLinear
    from tests.comera.formats.layout_checks import check_layer

    torch.manual_seed(0)
    layer = GatedLinear(6, 6, "tr", ranks=(2, 3, 2, 3), in_modes=(2, 3), out_modes=(3, 2),
                        dtype=torch.float64)
    assert layer.layout.bonds == ("r0", "r1", "r2", "r3") and layer.bond_sizes == (2, 3, 2, 3)
    check_layer(layer, _gen(10))


def _ring_layer():
    from comera.layers.linear import GatedLinear

    torch.manual_seed(1)
    return GatedLinear(6, 6, "tr", ranks=(3, 3, 2, 3), in_modes=(2, 3), out_modes=(3, 2),
                       dtype=torch.float64)


def test_pruning_a_ring_bond_cuts_it_from_both_carriers():
    from tests.comera.formats.layout_checks import check_pruned_slices_leave

    check_pruned_slices_leave(_ring_layer(), {0: [1], 2: [0]}, _gen(11))


def test_truncating_the_closing_bond_keeps_the_function_and_adam_state():
    from tests.comera.formats.layout_checks import check_truncate

    check_truncate(_ring_layer(), {0: [0, 2], 1: [1]}, _gen(12))


def test_round_layer_frees_a_rings_padding_and_keeps_the_function():
    from comera.layers.linear import GatedLinear
    from comera.ranks.truncate import round_layer_

    layer = GatedLinear(4, 6, "tr", ranks=4, in_modes=(2, 2), out_modes=(3, 2),
                        dtype=torch.float64)
    small = TR.layout((2, 2), (3, 2), 2)
    with torch.no_grad():
        for core, c in zip(layer.cores, random_cores(small, _gen(13)), strict=True):
            core.zero_()
            core[:2, :, :2] = c
    x = torch.randn(3, 4, dtype=torch.float64)
    before = layer(x).detach()
    assert layer.bond_ranks == (4, 4, 4, 4)
    assert round_layer_(layer) is True
    assert all(r <= 2 for r in layer.bond_ranks)
    torch.testing.assert_close(layer(x), before, rtol=1e-10, atol=1e-12)
