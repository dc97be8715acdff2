"""The cotengra finder: beyond the exact search's reach, cotengra's hyper-optimizer (greedy
trials only) on a share of the remaining budget."""

from __future__ import annotations

from tncomp.compiler.finders.exact import EXACT_DP_LIMIT
from tncomp.compiler.problem import Tree

COTENGRA_MAX_S = 0.5  # cotengra's share of the budget (its greedy trials, then it stops)


def cotengra_finder(space) -> list[Tree]:
    if space.chain is not None or space.n <= EXACT_DP_LIMIT:
        return []
    if space.budget.spent:
        space.budget.stopped("cotengra", space.n)
        return []
    max_time = min(space.budget.remaining(), COTENGRA_MAX_S)
    return [space.tree(cotengra_path(space.inputs, space.output, space.sizes, max_time))]


def cotengra_path(inputs, output, sizes, max_time: float):
    import cotengra  # imported lazily: it is slow to import and only large networks need it

    # greedy trials only (no subtree reconfiguration: at 64 operands one trial of it took 1 s)
    opt = cotengra.HyperOptimizer(max_repeats=64, max_time=max(max_time, 1e-3), progbar=False,
                                  minimize="flops", methods=["greedy"], parallel=False,
                                  reconf_opts=None)
    tree = opt.search([tuple(t) for t in inputs], tuple(output), sizes)
    return tree.get_path()
