"""The left-to-right finder: operands contracted in their order, always a candidate (the
fallback whatever the budget)."""

from __future__ import annotations

from tncomp.compiler.problem import Tree


def sequential_finder(space) -> list[Tree]:
    steps, node = [], 0
    for k in range(1, space.n):
        steps.append((node, k))
        node = space.n + k - 1
    return [Tree(space.n, tuple(steps))]
