"""Permute copies run as blocked 2-D transposes give exactly torch's permute, for every swap
shape (and plain copies for the rest)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tncomp.compiler.ops import as_swap, blocked
from tncomp.runtime.transpose import permute_into

SHAPES = [(64, 12, 8, 8), (8, 12, 16, 64), (3, 70, 1, 80), (2, 3, 4, 5), (130, 70)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
def test_every_permutation_matches_torch(shape, dtype):
    src = torch.randn(math.prod(shape), dtype=dtype)
    for perm in itertools.permutations(range(len(shape))):
        expected = src.reshape(shape).permute(perm).contiguous()
        out = torch.empty(expected.shape, dtype=dtype)
        got = permute_into(out, src, shape, perm, as_swap(shape, perm))
        assert got is out and torch.equal(got, expected), perm


def test_large_swaps_take_the_blocked_path():
    assert blocked(as_swap((64, 12, 8, 8), (2, 3, 0, 1)))  # (b, i1 | i2, i3) -> (i2, i3 | b, i1)
    assert blocked(as_swap((3, 70, 80), (0, 2, 1)))  # three 70x80 transposes
    assert not blocked(as_swap((8, 12, 16, 64), (1, 2, 0, 3)))  # inner runs of 64 kept: a copy
    assert not blocked(as_swap((2, 3), (1, 0)))  # too small to gain
    assert not blocked(None)
