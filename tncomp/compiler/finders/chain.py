"""The chain finder: a chain network's trees from the interval dynamic program of
:mod:`tncomp.compiler.chain` (polynomial time; it replaces the exact search there)."""

from __future__ import annotations

from tncomp.compiler.problem import Tree


def chain_finder(space) -> tuple[Tree, ...]:
    return space.chain or ()
