"""The exact finders: opt_einsum's 'optimal' on a few operands and its 'dp' (minimising FLOPs,
and size) on networks that are no chain, both against the search's time budget."""

from __future__ import annotations

import opt_einsum

from tncomp.compiler.budget import Budget, OutOfBudget
from tncomp.compiler.problem import Tree

EXACT_OPTIMAL_LIMIT = 5  # opt_einsum 'optimal' up to this many operands ('dp' is as exact)
EXACT_DP_LIMIT = 16  # opt_einsum 'dp' up to this many; cotengra beyond
OUTER_DP_LIMIT = 10  # 'dp' searches outer products up to this many operands (3^n subsets)


def optimal_finder(space) -> list[Tree]:
    if space.n > EXACT_OPTIMAL_LIMIT:
        return []
    return [space.tree(opt_einsum.paths.optimal(list(space.inputs), space.output, space.sizes))]


def dp_finder(space) -> list[Tree]:
    """'dp' where the network is no chain (the chain's interval DP replaces it there), with
    outer products only on small networks (with them it visits every subset)."""
    if space.chain is not None or space.n > EXACT_DP_LIMIT:
        return []
    searches = [("flops", True), ("size", True)] if space.n <= OUTER_DP_LIMIT else [
        ("flops", False)]
    trees = []
    for minimize, outer in searches:
        what = f"dp ({minimize}{', outer products' if outer else ''})"
        path = None if space.budget.spent else bounded_dp(space.inputs, space.output,
                                                          space.sizes, minimize, outer,
                                                          space.budget)
        if path is None:
            space.budget.stopped(what, space.n)
        else:
            trees.append(space.tree(path))
    return trees


def bounded_dp(inputs, output, sizes, minimize: str, outer: bool, budget: Budget):
    """opt_einsum's dynamic program (``minimize`` is ``"flops"`` or ``"size"``), stopped when
    ``budget`` is spent: its path, or None when it ran out. The budget is read from inside the
    program's comparison of two subgraphs, its innermost step."""
    compare = getattr(opt_einsum.paths, f"_dp_compare_{minimize}", None)
    if compare is None:  # another opt_einsum: no hook, so only what cannot take long
        if len(inputs) > OUTER_DP_LIMIT // 2:
            return None
        compare = minimize

    def checked(*args):
        budget.check()
        return compare(*args)

    dp = opt_einsum.paths.DynamicProgramming(
        minimize=checked if callable(compare) else compare, search_outer=outer)
    try:
        return dp(list(inputs), output, sizes)
    except OutOfBudget:
        return None
