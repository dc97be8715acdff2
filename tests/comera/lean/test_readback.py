"""comera.lean.readback: many device values read back at once, with the answers a tensor at a
time would give."""

from __future__ import annotations

import pytest
import torch

from comera.lean.readback import all_finite, any_true, count_true


def test_any_and_count_match_one_tensor_at_a_time():
    gen = torch.Generator().manual_seed(0)
    masks = [torch.rand(n, generator=gen) > 0.7 for n in (1, 5, 9, 40)] + [torch.zeros(3) > 1]
    assert any_true(masks) == [bool(m.any()) for m in masks]
    assert count_true(masks) == [int(m.sum()) for m in masks]
    assert any_true([]) == [] and count_true([]) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
def test_all_finite_finds_any_non_finite_entry_and_changes_nothing(dtype, bad):
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(4, 3, generator=gen).to(dtype), torch.randn(7, generator=gen).to(dtype),
               torch.randn(2, 2, generator=gen, dtype=torch.float64)]  # a second dtype group
    if bad is not None:
        tensors[1][5] = bad
    before = [t.clone() for t in tensors]
    assert all_finite(tensors) is (bad is None)
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t.isnan(), b.isnan())
        assert torch.equal(t.nan_to_num(), b.nan_to_num())  # bit for bit where finite


def test_all_finite_on_huge_and_tiny_finite_values_integers_sparse_and_graphs():
    assert all_finite([torch.tensor([3e38, -3e38, 1e-45])])  # no overflow: no norm is taken
    assert all_finite([torch.arange(5)])  # integers are always finite
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, float("inf")]),
                                     (4,))
    assert not all_finite([sparse])
    x = torch.randn(3, requires_grad=True)
    y = x * 2  # in a graph: checked without writing into it
    assert all_finite([y]) and not all_finite([y / 0])
    y.sum().backward()  # the graph is intact
    assert all_finite([])
