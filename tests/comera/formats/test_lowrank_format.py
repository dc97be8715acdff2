"""The gated low-rank format (comera.formats.lowrank): layout, network, truncated SVD, rounding."""

from __future__ import annotations

import re

import pytest
import torch

from comera.errors import ConfigError
from comera.formats.lowrank import LowRank
from comera.formats.registry import get_format
from tests.comera.formats.format_checks import (
    F64,
    check_compiled_matches_einsum,
    check_gradients,
    random_cores,
)

FMT = LowRank()


def test_registered():
    assert isinstance(get_format("lowrank"), LowRank)
    assert FMT.exact_decomposition and not FMT.uses_modes


def test_layout_is_two_factors():
    layout = FMT.layout((6,), (5,), 3)
    assert layout.inputs == ("i",) and layout.outputs == ("o",)
    assert layout.cores == (("i", "r"), ("r", "o")) and layout.bonds == ("r",)
    assert layout.core_shapes == ((6, 3), (3, 5))
    assert layout.carriers("r") == ((0, 1), (1, 0))  # the gate folds into A


def test_modes_are_multiplied_out_and_rank_capped():
    layout = FMT.layout((2, 3), (5,), 9)
    assert layout.in_modes == (6,) and layout.bond_sizes == (5,)


@pytest.mark.parametrize(("ranks", "named"), [
    (0, "ranks=0"), (False, "ranks=False"), ("2", "ranks='2'"), ([2, 2], "ranks=(2, 2)"),
    ([6], "ranks[0]=6"),
])
def test_bad_ranks_name_the_value(ranks, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        FMT.layout((6,), (5,), ranks)


def test_parameters_at():
    layout = FMT.layout((768,), (3072,), 12)
    assert layout.parameters_at((12,)) == 12 * (768 + 3072)


def test_compiled_matches_dense_and_einsum(one_thread):
    check_compiled_matches_einsum(FMT, FMT.layout((7,), (5,), 3))


def test_gradcheck_and_gradgradcheck(one_thread):
    check_gradients(FMT, FMT.layout((4,), (3,), 2))


def test_svd_at_full_rank_reproduces_w():
    w = torch.randn(6, 9, dtype=F64)
    layout = FMT.layout((6,), (9,), 6)
    torch.testing.assert_close(layout.dense(FMT.decompose(w, layout)), w, rtol=1e-12,
                               atol=1e-12)


def test_truncated_svd_error_is_the_eckart_young_optimum():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(8, 10, generator=gen, dtype=F64)
    layout = FMT.layout((8,), (10,), 3)
    a, b = FMT.decompose(w, layout)
    s = torch.linalg.svdvals(w)
    torch.testing.assert_close((a @ b - w).norm(), s[3:].norm())
    torch.testing.assert_close(a.T @ a, b @ b.T)  # singular values split evenly


def test_round_keeps_the_product_and_never_grows():
    layout = FMT.layout((6,), (5,), 4)
    cores = random_cores(layout, seed=2)
    rounded = FMT.round(cores, layout)
    assert rounded[0].shape == (6, 4) and rounded[1].shape == (4, 5)
    torch.testing.assert_close(rounded[0] @ rounded[1], cores[0] @ cores[1])


def test_round_shrinks_a_redundant_layout():
    """Stored at r = 5, the product has rank 2: rounding finds it and balances the factors."""
    gen = torch.Generator().manual_seed(3)
    layout = FMT.layout((7,), (6,), 5)
    a = torch.randn(7, 2, generator=gen, dtype=F64) @ torch.randn(2, 5, generator=gen, dtype=F64)
    b = torch.randn(5, 6, generator=gen, dtype=F64)
    ra, rb = FMT.round([a, b], layout)
    assert ra.shape == (7, 2) and rb.shape == (2, 6)
    torch.testing.assert_close(ra @ rb, a @ b, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ra.T @ ra, rb @ rb.T)
    assert torch.allclose(ra.T @ ra, torch.diag(torch.linalg.svdvals(a @ b)[:2]))
