"""The Tucker format (comera.formats.tucker): layout, compiled network, HOSVD, exact rounding."""

from __future__ import annotations

import math
import re

import pytest
import torch

from comera.errors import ConfigError
from comera.formats.registry import get_format
from comera.formats.tucker import Tucker, hosvd, mode_product
from tests.comera.formats.format_checks import (
    F64,
    check_compiled_matches_einsum,
    check_gradients,
    plan_flops_over_optimal,
    random_cores,
)

FMT = Tucker()


def _unfold(t: torch.Tensor, k: int) -> torch.Tensor:
    return t.movedim(k, 0).reshape(t.shape[k], -1)


def _tucker_tensor(modes, ranks, seed=0) -> torch.Tensor:
    """A random float64 tensor of multilinear rank ``ranks``."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(ranks, generator=gen, dtype=F64)
    for k, n in enumerate(modes):
        t = mode_product(t, torch.randn(n, ranks[k], generator=gen, dtype=F64), k)
    return t


def test_registered():
    assert isinstance(get_format("tucker"), Tucker)
    assert FMT.exact_decomposition and FMT.uses_modes


def test_layout_factors_then_core():
    layout = FMT.layout((2, 3), (4,), 3)
    assert layout.inputs == ("i1", "i2") and layout.outputs == ("o1",)
    assert layout.cores == (("i1", "a1"), ("i2", "a2"), ("o1", "a3"), ("a1", "a2", "a3"))
    assert layout.bonds == ("a1", "a2", "a3")
    assert layout.bond_sizes == (2, 3, 3)  # an int rank is capped at each mode's size
    assert layout.carriers("a2") == ((1, 1), (3, 1))  # the gate folds into the factor


def test_int_rank_capped_at_the_unfolding_rank():
    # modes (2, 5): the mode-2 unfolding is 5 x 2, so a2 is at most 2
    assert FMT.layout((2,), (5,), 9).bond_sizes == (2, 2)


def test_one_rank_per_mode():
    layout = FMT.layout((4, 6), (6, 4), [1, 2, 3, 4])
    assert layout.bond_sizes == (1, 2, 3, 4)
    assert layout.core_shapes == ((4, 1), (6, 2), (6, 3), (4, 4), (1, 2, 3, 4))


@pytest.mark.parametrize(("ranks", "named"), [
    (0, "ranks=0"), (-2, "ranks=-2"), (True, "ranks=True"), (2.5, "ranks=2.5"),
    ("3", "ranks='3'"), ([2, 3], "ranks=(2, 3)"), ([2, 0, 3, 2], "ranks[1]=0"),
    ([2, 9, 3, 2], "ranks[1]=9"),
])
def test_bad_ranks_name_the_value(ranks, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        FMT.layout((4, 6), (6, 4), ranks)


def test_bad_modes():
    with pytest.raises(ConfigError, match="in_modes"):
        FMT.layout((0, 3), (4,), 2)


def test_parameters_at():
    layout = FMT.layout((4, 6), (6, 4), 3)
    assert layout.parameters_at((3, 3, 3, 3)) == 3 * (4 + 6 + 6 + 4) + 3**4
    assert layout.parameters_at((1, 2, 3, 4)) == 4 + 12 + 18 + 16 + 24
    assert layout.parameters_at(layout.bond_sizes) == sum(map(math.prod, layout.core_shapes))


def test_compiled_matches_dense_and_einsum(one_thread):
    check_compiled_matches_einsum(FMT, FMT.layout((2, 3), (3, 2), [2, 2, 3, 2]))
    check_compiled_matches_einsum(FMT, FMT.layout((4,), (2, 3), 2), batch=5)


@pytest.mark.parametrize(("in_modes", "out_modes", "ranks"), [
    ((6,), (4,), 3), ((2, 2, 2), (2, 2, 2), 2), ((3,), (2, 2), 2)])
def test_compiled_matches_at_one_and_three_modes(in_modes, out_modes, ranks, one_thread):
    check_compiled_matches_einsum(FMT, FMT.layout(in_modes, out_modes, ranks))


def test_gradcheck_and_gradgradcheck(one_thread):
    check_gradients(FMT, FMT.layout((2, 2), (3,), 2))


@pytest.mark.parametrize("batch", [128, 4096])
def test_plan_is_near_the_fewest_flops(batch):
    """tncomp plans x through the factors and the core (choosing by modelled time, so up to a
    little above the fewest FLOPs); a plan that built W first would be far above."""
    layout = FMT.layout((12, 8, 8), (12, 16, 16), 6)
    assert plan_flops_over_optimal(FMT, layout, batch) < 1.5


def test_hosvd_at_full_rank_reproduces_w():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(6, 12, generator=gen, dtype=F64)
    layout = FMT.layout((2, 3), (3, 4), 12)
    cores = FMT.decompose(w, layout)
    assert [tuple(c.shape) for c in cores] == list(layout.core_shapes)
    torch.testing.assert_close(layout.dense(cores), w, rtol=1e-12, atol=1e-12)
    for u in cores[:-1]:  # orthonormal factors
        torch.testing.assert_close(u.T @ u, torch.eye(u.shape[1], dtype=F64))


def test_decompose_keeps_the_weights_dtype():
    w = torch.randn(6, 6)
    cores = FMT.decompose(w, FMT.layout((2, 3), (3, 2), 6))
    assert all(c.dtype == torch.float32 and c.is_contiguous() for c in cores)


def test_hosvd_at_multilinear_rank_is_exact():
    modes, ranks = (4, 5), (2, 3)
    t = _tucker_tensor((*modes, 6), (*ranks, 2), seed=2)
    layout = FMT.layout(modes, (6,), [2, 3, 2])
    cores = FMT.decompose(t.reshape(20, 6), layout)
    torch.testing.assert_close(layout.dense(cores), t.reshape(20, 6), rtol=1e-10, atol=1e-10)


def test_truncated_hosvd_error_within_its_bounds():
    """``max_k tail_k <= ||W - W_hat||^2 <= sum_k tail_k`` with tail_k the squared singular
    values of unfolding k past a_k (De Lathauwer et al. 2000)."""
    gen = torch.Generator().manual_seed(3)
    modes, ranks = (4, 5, 3, 6), (2, 3, 2, 4)
    t = torch.randn(modes, generator=gen, dtype=F64)
    layout = FMT.layout(modes[:2], modes[2:], list(ranks))
    w_hat = layout.dense(FMT.decompose(t.reshape(20, 18), layout))
    err2 = float((w_hat - t.reshape(20, 18)).norm() ** 2)
    tails = [float((torch.linalg.svdvals(_unfold(t, k))[r:] ** 2).sum())
             for k, r in enumerate(ranks)]
    assert max(tails) - 1e-9 <= err2 <= sum(tails) + 1e-9
    assert err2 > 0


def test_round_keeps_the_weight_and_never_grows(one_thread):
    layout = FMT.layout((2, 3), (3, 2), [2, 3, 3, 2])
    cores = random_cores(layout, seed=5)
    rounded = FMT.round(cores, layout)
    torch.testing.assert_close(layout.dense(rounded), layout.dense(cores), rtol=1e-10,
                               atol=1e-10)
    new = tuple(u.shape[1] for u in rounded[:-1])
    assert all(n <= b for n, b in zip(new, layout.bond_sizes, strict=True))
    assert rounded[-1].shape == new


def test_round_shrinks_a_redundant_layout_to_the_multilinear_rank():
    """Stored at ranks (3, 4, 3), the weight has multilinear rank (2, 2, 3): rounding finds it."""
    gen = torch.Generator().manual_seed(6)
    layout = FMT.layout((3, 4), (5,), [3, 4, 3])
    factors = [torch.randn(3, 2, generator=gen, dtype=F64) @ torch.randn(2, 3, generator=gen,
                                                                          dtype=F64),
               torch.randn(4, 2, generator=gen, dtype=F64) @ torch.randn(2, 4, generator=gen,
                                                                          dtype=F64),
               torch.randn(5, 3, generator=gen, dtype=F64)]
    core = torch.randn(3, 4, 3, generator=gen, dtype=F64)
    cores = [*factors, core]
    w = layout.dense(cores)
    expected = tuple(int(torch.linalg.matrix_rank(_unfold(w.reshape(3, 4, 5), k)))
                     for k in range(3))
    assert expected == (2, 2, 3)
    rounded = FMT.round(cores, layout)
    assert tuple(u.shape[1] for u in rounded[:-1]) == expected
    small = layout.resized(dict(zip(layout.bonds, expected, strict=True)))
    torch.testing.assert_close(small.dense(rounded), w, rtol=1e-10, atol=1e-10)


def test_round_of_a_zero_weight_keeps_one_slice():
    layout = FMT.layout((2,), (3,), 2)
    cores = [torch.zeros(s, dtype=F64) for s in layout.core_shapes]
    rounded = FMT.round(cores, layout)
    assert [tuple(c.shape) for c in rounded] == [(2, 1), (3, 1), (1, 1)]


def test_hosvd_shrinks_to_the_available_rank():
    t = torch.randn(2, 5, dtype=F64)
    _u1, u2, core = hosvd(t, (2, 4))
    assert u2.shape == (5, 2) and core.shape == (2, 2)
