"""The primitive steps of a plan: a permute seen as a swap of two blocks."""

from __future__ import annotations

from tncomp.compiler.ops import Permute, Swap, as_swap, inner_run


def test_as_swap_merges_axes_that_move_together():
    assert as_swap((4096, 12, 8, 8), (2, 3, 0, 1)) == Swap(1, 49152, 64, 1)
    assert as_swap((12, 16, 16, 4096), (3, 0, 1, 2)) == Swap(1, 3072, 4096, 1)
    assert as_swap((8, 12, 16, 4096), (1, 2, 0, 3)) == Swap(1, 8, 192, 4096)
    assert as_swap((5, 4, 1, 3), (0, 3, 2, 1)) == Swap(5, 4, 3, 1)  # size-1 axes ignored
    assert as_swap((8, 12, 16, 4096), (3, 1, 2, 0)) is None  # three blocks move
    assert as_swap((4, 5), (0, 1)) is None  # nothing moves


def test_inner_run_and_kind_say_how_fast_a_copy_can_go():
    assert inner_run((8, 12, 16, 4096), (1, 2, 0, 3)) == 4096  # the innermost axis stays
    assert inner_run((4096, 12, 8, 8), (0, 2, 1, 3)) == 8
    assert inner_run((8, 12, 16, 4096), (3, 1, 2, 0)) == 1
    kinds = {perm: Permute(1, 0, shape, perm, 0).kind for shape, perm in (
        ((8, 12, 16, 4096), (1, 2, 0, 3)), ((4096, 12, 8, 8), (2, 3, 0, 1)),
        ((8, 12, 16, 4096), (3, 1, 2, 0)))}
    assert list(kinds.values()) == ["runs", "transpose", "gather"]
