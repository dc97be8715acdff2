"""The embedding benchmark's naive baseline: every lookup's row from its own core slices,
equal to TTEmbedding's rows (float64) for any number of cores, repeated ids included."""

from __future__ import annotations

import pytest
import torch

import comera
from benchmarks.speed.bench_embedding import digits, naive_gather_rows


def test_digits_are_row_major_by_hand():
    ids = torch.tensor([0, 1, 5, 23, 17])
    assert [d.tolist() for d in digits(ids, (2, 3, 4))] == [
        [0, 0, 0, 1, 1], [0, 0, 1, 2, 1], [0, 1, 1, 3, 1]]  # 17 = 1*12 + 1*4 + 1


@pytest.mark.parametrize("d", [2, 3, 4])
def test_naive_gather_equals_the_layer(d):
    torch.manual_seed(0)
    layer = comera.TTEmbedding(1000, 8, ranks=5, d=d, dtype=torch.float64)
    with torch.no_grad():
        for gate in layer.gates:  # gates away from 1, so a missed gate shows
            gate.uniform_(0.5, 1.5)
    ids = torch.randint(0, 1000, (64,))
    ids[:8] = ids[8]  # repeated ids
    expected = layer(ids)
    got = naive_gather_rows(layer, ids)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(got.square().sum(), list(layer.cores))
    want = torch.autograd.grad(expected.square().sum(), list(layer.cores))
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
