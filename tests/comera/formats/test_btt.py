"""The block tensor-train format (comera.formats.btt): layout, network, block SVD, rounding."""

from __future__ import annotations

import pytest
import torch

from comera.errors import ConfigError
from comera.formats.btt import BlockTT, block_svd, btt_rank_bounds
from comera.formats.registry import get_format
from tests.comera.formats.layout_checks import check_network, random_cores

BTT = BlockTT()


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _at(layout, cores):
    """The layout at the bond sizes ``cores`` carry (bond k on core k's last axis)."""
    return layout.resized({b: cores[k].shape[-1] for k, b in enumerate(layout.bonds)})


def _by_steps(x: torch.Tensor, cores: list[torch.Tensor], d: int) -> torch.Tensor:
    """The BTT product as the paper's operator runs it, one einsum per core, written from the
    definition (not from the layout): core k eats input mode k and the bond, makes output mode
    k and the next bond, batched over the outputs made so far and the inputs still to come."""
    letters_in, letters_out = "ijklm"[:d], "opqst"[:d]
    v = x  # (b, i_1 .. i_d)
    state = "z" + letters_in
    for k, core in enumerate(cores):
        left = "R" if k else ""
        right = "S" if k < d - 1 else ""
        term = left + letters_in[k:] + letters_out[:k + 1] + right
        out = "z" + right + letters_in[k + 1:] + letters_out[:k + 1]
        v = torch.einsum(f"{state},{term}->{out}", v, core)
        state = out.replace("S", "R")
    return v


def test_registered_under_btt():
    assert isinstance(get_format("btt"), BlockTT)


def test_two_cores_are_the_papers_blocks():
    layout = BTT.layout((2, 3), (4, 5), 2)
    assert layout.cores == (("i1", "i2", "o1", "r1"), ("r1", "i2", "o1", "o2"))
    assert layout.bonds == ("r1",)
    assert layout.core_shapes == ((2, 3, 4, 2), (2, 3, 4, 5))


def test_d_cores_trade_one_input_for_one_output_each():
    layout = BTT.layout((2, 3, 2), (3, 2, 2), (2, 3))
    assert layout.cores == (("i1", "i2", "i3", "o1", "r1"), ("r1", "i2", "i3", "o1", "o2", "r2"),
                            ("r2", "i3", "o1", "o2", "o3"))
    assert layout.bonds == ("r1", "r2")


@pytest.mark.parametrize("in_modes, out_modes, ranks", [
    ((2, 3), (4, 5), 2), ((2, 3, 2), (3, 2, 2), (2, 3)), ((4, 4), (4, 4), 1)])
def test_matches_the_step_by_step_operator(in_modes, out_modes, ranks):
    gen = _gen(1)
    layout = BTT.layout(in_modes, out_modes, ranks)
    cores = random_cores(layout, gen)
    x = torch.randn(3, *in_modes, generator=gen, dtype=torch.float64)
    y = x.reshape(3, -1) @ layout.dense(cores)
    torch.testing.assert_close(y, _by_steps(x, cores, len(in_modes)).reshape(3, -1),
                               rtol=1e-12, atol=1e-12)


def test_rank_one_two_cores_is_monarch_every_block_rank_one():
    layout = BTT.layout((4, 3), (3, 5), 1)
    w = layout.dense(random_cores(layout, _gen(2))).reshape(4, 3, 3, 5)  # (i1, i2, o1, o2)
    for i2 in range(3):
        for o1 in range(3):
            assert torch.linalg.matrix_rank(w[:, i2, o1, :]) == 1


def test_parameter_count():
    n, r = 8, 3
    layout = BTT.layout((n, n), (n, n), r)
    assert layout.parameters_at(layout.bond_sizes) == 2 * r * n ** 3
    layout = BTT.layout((2, 3, 4), (5, 6, 7), (2, 3))
    expected = (2 * 3 * 4 * 5 * 2) + (2 * 3 * 4 * 5 * 6 * 3) + (3 * 4 * 5 * 6 * 7)
    assert layout.parameters_at(layout.bond_sizes) == expected


def test_an_int_rank_is_capped_at_the_block_svds_ranks():
    assert btt_rank_bounds((2, 3, 4), (5, 6, 7)) == (min(2, 42), min(6, 7))
    assert BTT.layout((2, 3, 4), (5, 6, 7), 100).bond_sizes == (2, 6)
    assert BTT.layout((2, 3, 4), (5, 6, 7), 3).bond_sizes == (2, 3)


@pytest.mark.parametrize("ranks", [0, -1, True, 1.5, "2", (2,), (2, 0), (2, 2, 2)])
def test_bad_ranks_name_the_value(ranks):
    with pytest.raises(ConfigError, match="ranks"):
        BTT.layout((2, 3, 2), (3, 2, 2), ranks)


@pytest.mark.parametrize("in_modes, out_modes", [((6,), (4,)), ((2, 3), (4,)),
                                                  ((2, 3), (2, 2, 1))])
def test_modes_must_pair_up_two_or_more(in_modes, out_modes):
    with pytest.raises(ConfigError, match=r"in_modes .* out_modes"):
        BTT.layout(in_modes, out_modes, 2)


@pytest.mark.parametrize("in_modes, out_modes, ranks", [
    ((2, 3), (3, 2), 2), ((2, 2, 2), (2, 3, 2), (2, 3))])
def test_network_matches_dense_and_einsum(in_modes, out_modes, ranks):
    check_network(BTT, BTT.layout(in_modes, out_modes, ranks), _gen(3))


@pytest.mark.parametrize("in_modes, out_modes", [((2, 3), (3, 2)), ((4, 3), (2, 5)),
                                                  ((2, 3, 2), (2, 2, 3)), ((3, 2, 2), (2, 4, 1))])
def test_block_svd_at_full_rank_reproduces_the_weight(in_modes, out_modes):
    layout = BTT.layout(in_modes, out_modes, 10_000)
    w = torch.randn(layout.in_features, layout.out_features, generator=_gen(4),
                    dtype=torch.float64)
    cores = BTT.decompose(w, layout)
    assert [tuple(c.shape) for c in cores] == list(layout.core_shapes)
    torch.testing.assert_close(layout.dense(cores), w, rtol=0, atol=1e-12)


def test_two_core_block_svd_error_is_each_blocks_dropped_singular_values():
    w = torch.randn(5 * 3, 4 * 6, generator=_gen(5), dtype=torch.float64)
    layout = BTT.layout((5, 3), (4, 6), 2)
    cores = BTT.decompose(w, layout)
    blocks = w.reshape(5, 3, 4, 6).permute(1, 2, 0, 3)  # (i2, o1 | i1, o2)
    dropped = torch.linalg.svdvals(blocks)[..., 2:]
    err = torch.linalg.norm(layout.dense(cores) - w)
    torch.testing.assert_close(err, dropped.norm(), rtol=1e-10, atol=1e-12)


def test_block_svd_recovers_a_btt_at_its_ranks():
    gen = _gen(6)
    layout = BTT.layout((2, 3, 2), (2, 2, 3), (2, 2))
    w = layout.dense(random_cores(layout, gen))
    cores = block_svd(w, layout.in_modes, layout.out_modes, layout.bond_sizes)
    torch.testing.assert_close(layout.dense(cores), w, rtol=0, atol=1e-12)


def test_round_is_exact_and_finds_the_smaller_ranks():
    gen = _gen(7)
    small = BTT.layout((2, 3, 2), (2, 2, 3), 1)
    w = small.dense(random_cores(small, gen))
    full = BTT.layout((2, 3, 2), (2, 2, 3), 10_000)
    rounded = BTT.round(BTT.decompose(w, full), full)
    assert [c.shape[-1] for c in rounded[:-1]] == [1, 1]
    torch.testing.assert_close(_at(full, rounded).dense(rounded), w, rtol=0, atol=1e-12)


def test_round_keeps_a_full_rank_btt():
    layout = BTT.layout((3, 3), (3, 3), 3)
    cores = random_cores(layout, _gen(8))
    rounded = BTT.round(cores, layout)
    assert [tuple(c.shape) for c in rounded] == list(layout.core_shapes)
    torch.testing.assert_close(layout.dense(rounded), layout.dense(cores), rtol=0, atol=1e-12)



# -- the layer ----------------------------------------------------------------------------------
def test_gated_linear_btt_equals_its_dense_reconstruction():
    from comera.layers.linear import GatedLinear
    from tests.comera.formats.layout_checks import check_layer

    torch.manual_seed(0)
    layer = GatedLinear(12, 12, "btt", ranks=(2, 3), in_modes=(2, 3, 2), out_modes=(3, 2, 2),
                        dtype=torch.float64)
    assert layer.bond_sizes == (2, 3)
    check_layer(layer, _gen(10))


def _btt_layer():
    from comera.layers.linear import GatedLinear

    torch.manual_seed(1)
    return GatedLinear(12, 12, "btt", ranks=(2, 3), in_modes=(2, 3, 2), out_modes=(3, 2, 2),
                       dtype=torch.float64)


def test_pruning_a_btt_bond_cuts_it_from_both_carriers():
    from tests.comera.formats.layout_checks import check_pruned_slices_leave

    check_pruned_slices_leave(_btt_layer(), {1: [0, 2]}, _gen(11))


def test_truncating_a_btt_keeps_the_function_and_adam_state():
    from tests.comera.formats.layout_checks import check_truncate

    check_truncate(_btt_layer(), {0: [1], 1: [2]}, _gen(12))


def test_round_layer_shrinks_a_low_rank_btt_and_keeps_the_function():
    from comera.layers.linear import GatedLinear
    from comera.ranks.truncate import round_layer_

    small = BTT.layout((2, 3, 2), (3, 2, 2), 1)
    w = small.dense(random_cores(small, _gen(13)))
    layer = GatedLinear(12, 12, "btt", ranks=(2, 3), in_modes=(2, 3, 2), out_modes=(3, 2, 2),
                        dtype=torch.float64)
    assert layer.load_weight_(w) is True
    x = torch.randn(3, 12, dtype=torch.float64)
    before = layer(x).detach()
    assert round_layer_(layer) is True
    assert layer.bond_ranks == (1, 1)
    torch.testing.assert_close(layer(x), before, rtol=1e-10, atol=1e-12)


def test_gated_linear_factorises_both_sides_into_d_modes():
    from comera.layers.linear import GatedLinear

    layer = GatedLinear(64, 96, "btt", ranks=4, d=2)
    assert len(layer.in_modes) == len(layer.out_modes) == 2 and layer.bond_sizes == (4,)
    assert layer(torch.randn(2, 64)).shape == (2, 96)
