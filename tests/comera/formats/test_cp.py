"""The CP format (comera.formats.cp): a hyperedge bond, the compiled network, ALS."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from comera.errors import ConfigError
from comera.formats.cp import CP, cp_als, cp_to_tensor
from comera.formats.registry import get_format
from tests.comera.formats.format_checks import (
    F64,
    check_compiled_matches_einsum,
    check_gradients,
    plan_flops_over_optimal,
    random_cores,
    relative_error,
)

FMT = CP()


def test_registered():
    assert isinstance(get_format("cp"), CP)
    assert not FMT.exact_decomposition  # ALS is approximate
    assert FMT.round([], FMT.layout((2,), (3,), 1)) is None  # no exact rounding


def test_layout_is_one_factor_per_mode_on_one_bond():
    layout = FMT.layout((2, 3), (4,), 5)
    assert layout.cores == (("i1", "r"), ("i2", "r"), ("o1", "r"))
    assert layout.bonds == ("r",) and layout.bond_sizes == (5,)
    assert layout.carriers("r") == ((0, 1), (1, 1), (2, 1))  # the gate folds into factor 1
    assert FMT.layout((2, 3), (4,), [5]).bond_sizes == (5,)


def test_int_rank_capped_at_the_largest_tensor_rank():
    # a (2, 3, 4) tensor has rank at most 2 * 3 = 6
    assert FMT.layout((2, 3), (4,), 100).bond_sizes == (6,)


def test_the_bond_is_a_hyperedge_of_the_network():
    net = FMT.network(FMT.layout((2, 3), (4,), 5))
    assert net.hyper == frozenset({"r"})


@pytest.mark.parametrize(("ranks", "named"), [
    (0, "ranks=0"), (True, "ranks=True"), (1.5, "ranks=1.5"), ([2, 3], "ranks=(2, 3)"),
    ([0], "ranks[0]=0"), ([7], "ranks[0]=7"),
])
def test_bad_ranks_name_the_value(ranks, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        FMT.layout((2, 3), (4,), ranks)


def test_parameters_at():
    layout = FMT.layout((4, 6), (6, 4), 7)
    assert layout.parameters_at((7,)) == 7 * (4 + 6 + 6 + 4)
    assert layout.parameters_at((1,)) == 20


def test_compiled_matches_dense_and_einsum(one_thread):
    check_compiled_matches_einsum(FMT, FMT.layout((2, 3), (3, 2), 4))
    check_compiled_matches_einsum(FMT, FMT.layout((4,), (2, 3), 3), batch=5)


@pytest.mark.parametrize(("in_modes", "out_modes", "ranks"), [
    ((6,), (4,), 3), ((2, 2, 2), (2, 2, 2), 2), ((3,), (2, 2), 2)])
def test_compiled_matches_at_one_and_three_modes(in_modes, out_modes, ranks, one_thread):
    check_compiled_matches_einsum(FMT, FMT.layout(in_modes, out_modes, ranks))


def test_gradcheck_and_gradgradcheck(one_thread):
    check_gradients(FMT, FMT.layout((2, 2), (3,), 3))


@pytest.mark.parametrize("batch", [128, 4096])
def test_plan_handles_the_hyperedge_at_the_fewest_flops(batch):
    """The hyperedge r (on every factor) is kept through the plan, never summed early: tncomp
    finds opt_einsum's fewest-FLOPs cost for CP's r rank-one terms."""
    layout = FMT.layout((12, 8, 8), (12, 16, 16), 64)
    assert plan_flops_over_optimal(FMT, layout, batch) < 1.2


def test_cp_to_tensor_matches_einsum():
    fs = random_cores(FMT.layout((2, 3), (4,), 3))
    torch.testing.assert_close(cp_to_tensor(fs), torch.einsum("ar,br,cr->abc", *fs))


def test_als_error_never_grows_from_sweep_to_sweep():
    gen = torch.Generator().manual_seed(1)
    t = torch.randn(3, 4, 5, 2, generator=gen, dtype=F64)
    errors = [relative_error(cp_to_tensor(cp_als(t, 4, sweeps)), t) for sweeps in range(8)]
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(errors))
    assert errors[-1] < errors[0]


def test_als_recovers_a_tensor_of_that_cp_rank():
    gen = torch.Generator().manual_seed(2)
    true = [torch.randn(n, 3, generator=gen, dtype=F64) for n in (4, 5, 6, 3)]
    t = cp_to_tensor(true)
    assert relative_error(cp_to_tensor(cp_als(t, 3, 60)), t) < 1e-8


def test_als_balances_the_factor_norms():
    t = torch.randn(3, 4, 5, dtype=F64)
    norms = torch.stack([f.norm(dim=0) for f in cp_als(t, 3, 3)])  # (N, r)
    torch.testing.assert_close(norms, norms[:1].expand_as(norms))


def test_decompose_fits_the_layout_and_keeps_dtype():
    gen = torch.Generator().manual_seed(3)
    layout = FMT.layout((2, 3), (3, 2), 4)
    w = torch.randn(6, 6, generator=gen)
    cores = FMT.decompose(w, layout)
    assert [tuple(c.shape) for c in cores] == list(layout.core_shapes)
    assert all(c.dtype == torch.float32 for c in cores)
    start = cp_to_tensor(cp_als(w.double().reshape(2, 3, 3, 2), 4, 0)).reshape(6, 6)
    assert relative_error(layout.dense(cores).double(), w.double()) < relative_error(start,
                                                                                   w.double())


def test_als_is_the_same_whichever_matrix_it_reads():
    """The halves only change how the products are grouped, not the sweep's updates."""
    t = torch.randn(3, 4, 2, 5, dtype=F64, generator=torch.Generator().manual_seed(4))
    ones, threes = cp_als(t, 3, 3, split=1), cp_als(t, 3, 3, split=3)
    for a, b in zip(ones, threes, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("split", [0, 4])
def test_als_split_out_of_range(split):
    with pytest.raises(ConfigError, match=f"split={split}"):
        cp_als(torch.randn(2, 3, 2, 2, dtype=F64), 2, 1, split=split)
