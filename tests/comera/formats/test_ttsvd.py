"""TT-SVD and the matrix <-> TT / TT-matrix conversions (comera.formats.ttsvd)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comera.errors import ConfigError
from comera.formats.ttsvd import (
    matrix_to_tt,
    matrix_to_ttm,
    tt_rank_bounds,
    tt_svd,
    tt_to_matrix,
    tt_to_tensor,
    ttm_to_matrix,
)


def _random_tt(modes: list[int], ranks: list[int], gen: torch.Generator) -> torch.Tensor:
    """A random float64 tensor of TT ranks at most ``ranks`` (interior)."""
    bonds = [1, *ranks, 1]
    cores = [
        torch.randn(bonds[k], n, bonds[k + 1], generator=gen, dtype=torch.float64)
        for k, n in enumerate(modes)
    ]
    return tt_to_tensor(cores)


def _check_chain(cores: list[torch.Tensor], shape: tuple[int, ...]) -> None:
    assert len(cores) == len(shape)
    assert cores[0].shape[0] == 1 and cores[-1].shape[2] == 1
    for k, core in enumerate(cores):
        assert core.shape[1] == shape[k]
        assert core.is_contiguous()
        if k:
            assert cores[k - 1].shape[2] == core.shape[0]


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=5),
    seed=st.integers(0, 2**31 - 1),
)
def test_exact_at_full_rank(shape: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensor = torch.randn(*shape, generator=gen, dtype=torch.float64)
    cores = tt_svd(tensor, None)
    _check_chain(cores, tuple(shape))
    assert tuple(c.shape[2] for c in cores[:-1]) == tt_rank_bounds(shape)
    torch.testing.assert_close(tt_to_tensor(cores), tensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtypes_kept(dtype: torch.dtype) -> None:
    tensor = torch.randn(4, 3, 5, dtype=dtype)
    cores = tt_svd(tensor, None)
    assert all(core.dtype == dtype for core in cores)
    torch.testing.assert_close(tt_to_tensor(cores), tensor)


def test_half_precision_is_computed_in_float32() -> None:
    tensor = torch.randn(4, 3, 5).to(torch.bfloat16)
    cores = tt_svd(tensor, None)
    assert all(core.dtype == torch.bfloat16 for core in cores)
    torch.testing.assert_close(tt_to_tensor(cores), tensor, atol=0.1, rtol=0.05)


def test_no_autograd_and_no_shared_storage() -> None:
    tensor = torch.randn(6, requires_grad=True)
    (core,) = tt_svd(tensor, None)
    assert core.shape == (1, 6, 1) and not core.requires_grad
    core.zero_()
    assert tensor.abs().sum() > 0


@pytest.mark.parametrize(
    ("modes", "true_ranks"),
    [([4, 5, 6], [2, 3]), ([3, 4, 4, 3], [2, 3, 2]), ([2, 3, 4, 3, 2], [2, 4, 4, 2])],
)
def test_truncation_is_exact_at_or_above_the_true_rank(
    modes: list[int], true_ranks: list[int]
) -> None:
    tensor = _random_tt(modes, true_ranks, torch.Generator().manual_seed(0))
    for extra in (0, 1, 3):
        cores = tt_svd(tensor, [r + extra for r in true_ranks])
        torch.testing.assert_close(tt_to_tensor(cores), tensor)
    ranks = tuple(core.shape[2] for core in tt_svd(tensor, max(true_ranks))[:-1])
    assert all(r <= max(true_ranks) for r in ranks)
    # Below the true rank the approximation error is real.
    cores = tt_svd(tensor, [max(r - 1, 1) for r in true_ranks])
    assert (tt_to_tensor(cores) - tensor).norm() > 1e-3 * tensor.norm()


@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=2, max_size=5),
    cap=st.integers(1, 8),
    seed=st.integers(0, 2**31 - 1),
)
def test_rank_caps_respected(shape: list[int], cap: int, seed: int) -> None:
    tensor = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    cores = tt_svd(tensor, cap)
    _check_chain(cores, tuple(shape))
    bounds = tt_rank_bounds(shape)
    assert tuple(c.shape[2] for c in cores[:-1]) == tuple(min(cap, b) for b in bounds)
    caps = [(k % 3) + 1 for k in range(len(shape) - 1)]
    cores = tt_svd(tensor, caps)
    assert all(c.shape[2] <= cap for c, cap in zip(cores[:-1], caps, strict=True))


def test_rank_bounds() -> None:
    assert tt_rank_bounds([8, 8, 12, 12, 16, 16]) == (8, 64, 768, 256, 16)
    assert tt_rank_bounds([7]) == ()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matrix_to_tt_round_trip(dtype: torch.dtype) -> None:
    in_modes, out_modes = (4, 2, 3), (3, 2, 2)
    weight = torch.randn(24, 12, dtype=dtype)
    cores = matrix_to_tt(weight, in_modes, out_modes, None)
    _check_chain(cores, (*in_modes, *out_modes))
    torch.testing.assert_close(tt_to_matrix(cores, len(in_modes)), weight)
    # Row-major layout: entry W[i, j] sits at the multi-index of (i, j) in the modes.
    full = tt_to_tensor(cores)
    i, j = 17, 7
    index = (*_unravel(i, in_modes), *_unravel(j, out_modes))
    torch.testing.assert_close(full[index], weight[i, j])


def _unravel(flat: int, modes: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(modes):
        out.append(flat % n)
        flat //= n
    return tuple(reversed(out))


def test_matrix_to_tt_of_a_linear_layer() -> None:
    layer = torch.nn.Linear(24, 16, bias=False).double()
    cores = matrix_to_tt(layer.weight.T, (2, 3, 4), (4, 2, 2), None)
    x = torch.randn(5, 24, dtype=torch.float64)
    torch.testing.assert_close(x @ tt_to_matrix(cores, 3), layer(x).detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ttm_round_trip(dtype: torch.dtype) -> None:
    row_modes, col_modes = (4, 2, 3), (3, 5, 2)
    weight = torch.randn(24, 30, dtype=dtype)
    cores = matrix_to_ttm(weight, row_modes, col_modes, None)
    assert [tuple(c.shape[1:3]) for c in cores] == list(zip(row_modes, col_modes, strict=True))
    assert cores[0].shape[0] == 1 and cores[-1].shape[3] == 1
    torch.testing.assert_close(ttm_to_matrix(cores), weight)


def test_ttm_layout_and_truncation() -> None:
    # A Kronecker product A (x) B has TT-matrix rank 1 in the (m1 n1, m2 n2) pairing.
    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    weight = torch.kron(a, b)
    cores = matrix_to_ttm(weight, (3, 5), (4, 2), 1)
    assert cores[0].shape == (1, 3, 4, 1) and cores[1].shape == (1, 5, 2, 1)
    torch.testing.assert_close(ttm_to_matrix(cores), weight)


def test_mismatched_modes_name_both_sizes() -> None:
    weight = torch.randn(24, 12)
    with pytest.raises(ConfigError, match=r"multiply to 25.*24"):
        matrix_to_tt(weight, (5, 5), (3, 4), None)
    with pytest.raises(ConfigError, match=r"multiply to 16.*12"):
        matrix_to_tt(weight, (4, 6), (4, 4), None)
    with pytest.raises(ConfigError, match=r"multiply to 30.*24"):
        matrix_to_ttm(weight, (5, 6), (3, 4), None)
    with pytest.raises(ConfigError, match="as many row modes"):
        matrix_to_ttm(weight, (4, 6), (12,), None)


@pytest.mark.parametrize(
    ("max_ranks", "match"),
    [(0, ">= 1"), ([2, 0], ">= 1"), ([2, 2, 2], "expected 2, got 3"), (True, "bool"), ("3", "str")],
)
def test_bad_ranks(max_ranks: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        tt_svd(torch.randn(2, 3, 4), max_ranks)  # type: ignore[arg-type]


def test_bad_inputs() -> None:
    with pytest.raises(ConfigError, match="floating-point"):
        tt_svd(torch.ones(2, 3, dtype=torch.int64), None)
    with pytest.raises(ConfigError, match="non-empty"):
        tt_svd(torch.randn(2, 0), None)
    with pytest.raises(ConfigError, match="2-d"):
        matrix_to_tt(torch.randn(2, 3, 4), (2,), (12,), None)
    with pytest.raises(ConfigError, match=">= 1"):
        matrix_to_tt(torch.randn(4, 3), (4, 0), (3,), None)
    with pytest.raises(ConfigError, match="left rank"):
        tt_to_tensor([torch.randn(1, 2, 3), torch.randn(2, 2, 1)])
    with pytest.raises(ConfigError, match="n_in_modes"):
        tt_to_matrix([torch.randn(1, 2, 1)], 2)
    with pytest.raises(ConfigError, match="4-d"):
        ttm_to_matrix([torch.randn(1, 2, 1)])


def test_unit_modes_allowed() -> None:
    weight = torch.randn(6, 4, dtype=torch.float64)
    cores = matrix_to_tt(weight, (1, 6), (4, 1), None)
    torch.testing.assert_close(tt_to_matrix(cores, 2), weight)
    assert math.prod(c.shape[1] for c in cores) == 24
