"""The tree finders: each proposes contraction trees for a bound problem, and the planner
scores every proposal (:func:`tncomp.compiler.search.candidate_trees` asks each finder in
registration order and keeps the distinct trees).

A finder is a function of one :class:`SearchSpace` returning trees (none where it does not
apply: too many operands, no chain, a spent budget). The built-in finders are one module each
below, registered in :data:`BUILTIN`'s order; :func:`register_tree_finder` adds a user's.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tncomp.compiler.budget import Budget
from tncomp.compiler.problem import Problem, Tree
from tncomp.errors import PlanError

__all__ = ["SearchSpace", "TreeFinder", "register_tree_finder", "tree_finders"]


@dataclass(frozen=True)
class SearchSpace:
    """What a finder sees: the problem, its operand index sets, output and sizes (opt_einsum's
    form), the time budget of the exact searches, and the chain trees (None when the problem is
    no chain or the search is unstructured)."""

    problem: Problem
    inputs: tuple[frozenset, ...]
    output: frozenset
    sizes: dict
    budget: Budget
    chain: tuple[Tree, ...] | None

    @property
    def n(self) -> int:
        """The number of operands."""
        return self.problem.n_leaves

    def tree(self, path) -> Tree:
        """The tree of an opt_einsum linear path."""
        return Tree.from_linear_path(self.n, path)


TreeFinder = Callable[[SearchSpace], Iterable[Tree]]
_FINDERS: dict[str, TreeFinder] = {}


def register_tree_finder(name: str, finder: TreeFinder, *, replace: bool = False) -> None:
    """Add ``finder`` under ``name`` (asked after the finders before it); ``replace`` swaps the
    finder of a name already registered, keeping its place."""
    if not isinstance(name, str) or not name:
        raise PlanError(f"tree finder name {name!r}; give a non-empty string.")
    if not callable(finder):
        raise PlanError(f"tree finder {name!r}: {finder!r} is not callable; give a function "
                        "of a SearchSpace returning trees.")
    if name in _FINDERS and not replace:
        raise PlanError(f"tree finder {name!r} is registered already; pass replace=True to "
                        "swap it.")
    _FINDERS[name] = finder


def tree_finders() -> dict[str, TreeFinder]:
    """The registered finders, in the order they are asked."""
    return dict(_FINDERS)


#: The built-in finders, in the order their trees join the candidates.
BUILTIN = (
    "chain:chain_finder",  # the interval DP of a chain (a TT layer)
    "exact:optimal_finder",  # opt_einsum 'optimal' on a few operands
    "exact:dp_finder",  # opt_einsum 'dp' where the network is no chain
    "hyper:cotengra_finder",  # cotengra beyond the exact search
    "greedy:greedy_finder",  # opt_einsum greedy: always a candidate
    "greedy:layout_greedy_finder",  # the same, avoiding copies
    "sequential:sequential_finder",  # left to right: always a candidate
)

for _entry in BUILTIN:
    _module, _, _function = _entry.partition(":")
    register_tree_finder(_function.removesuffix("_finder"),
                         getattr(importlib.import_module(f"{__name__}.{_module}"), _function))
