"""Search contraction trees for a bound problem, and choose among them by modelled time.

Candidates come from exact search where the network is small (opt_einsum 'optimal', then 'dp'
minimising FLOPs and size), cotengra's hyper-optimizer beyond that, opt_einsum's greedy, and the
plain left-to-right order. Each candidate is lowered with its backward pass and scored by the
device model on forward + backward time, not forward FLOPs alone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import opt_einsum

from tncomp.compiler.chain import chain_trees
from tncomp.compiler.device_model import DeviceModel
from tncomp.compiler.memory import Memory, apply_memory
from tncomp.compiler.plan import Plan, lower
from tncomp.compiler.problem import Problem, Tree
from tncomp.errors import PlanError

log = logging.getLogger("tncomp.compiler.search")

EXACT_OPTIMAL_LIMIT = 5  # opt_einsum 'optimal' up to this many operands ('dp' is as exact)
EXACT_DP_LIMIT = 16  # opt_einsum 'dp' up to this many; cotengra beyond


def _opt_inputs(problem: Problem):
    inputs = [frozenset(term) for term in problem.leaf_kept]
    output = frozenset(problem.output)
    sizes = {i: int(s) for i, s in problem.size_dict.items()}
    return inputs, output, sizes


def _sequential(n: int) -> Tree:
    steps, node = [], 0
    for k in range(1, n):
        steps.append((node, k))
        node = n + k - 1
    return Tree(n, tuple(steps))


def candidate_trees(problem: Problem, structured: bool = True) -> list[Tree]:
    """Distinct trees from several optimizers for a problem whose sizes are all ints.

    A chain network (a TT layer) gets the interval dynamic program of :mod:`chain` (polynomial
    time) in place of the exponential exact search, unless ``structured`` is False."""
    n = problem.n_leaves
    if n == 1:
        return [Tree(1, ())]
    inputs, output, sizes = _opt_inputs(problem)
    found: list[Tree] = []

    def keep(tree: Tree) -> None:
        if tree.signature() not in {t.signature() for t in found}:
            found.append(tree)

    def add(path) -> None:
        keep(Tree.from_linear_path(n, path))

    chain = chain_trees(problem) if structured else None
    for tree in chain or ():
        keep(tree)
    if n <= EXACT_OPTIMAL_LIMIT:
        add(opt_einsum.paths.optimal(inputs, output, sizes))
    if chain is not None:
        pass  # the interval DP replaces the exponential exact search on chains
    elif n <= EXACT_DP_LIMIT:
        for minimize in ("flops", "size"):
            dp = opt_einsum.paths.DynamicProgramming(minimize=minimize, search_outer=True)
            add(dp(list(inputs), output, sizes))
    else:
        add(_cotengra_path(inputs, output, sizes))
    add(opt_einsum.paths.greedy(inputs, output, sizes))
    seq = _sequential(n)
    if seq.signature() not in {t.signature() for t in found}:
        found.append(seq)
    return found


def _cotengra_path(inputs, output, sizes):
    import cotengra  # imported lazily: it is slow to import and only large networks need it

    opt = cotengra.HyperOptimizer(max_repeats=64, progbar=False, minimize="flops",
                                  methods=["greedy"], parallel=False)
    tree = opt.search([tuple(t) for t in inputs], tuple(output), sizes)
    return tree.get_path()


@dataclass(frozen=True)
class Choice:
    """The chosen plan of a bound problem and the candidates it beat (by modelled time).

    ``plans`` holds every candidate's lowered plan, best first, so callers (autotune) reuse
    them instead of lowering again."""

    plan: Plan
    candidates: tuple[tuple[Tree, float], ...]
    plans: tuple[Plan, ...] = ()


def choose_plan(
    problem: Problem,
    needs_grad: Sequence[bool],
    itemsize: int,
    model: DeviceModel,
    trees: Sequence[Tree] | None = None,
    memory: Memory = "fast",
) -> Choice:
    """Lower every candidate tree under the memory mode and keep the one with the least
    modelled fwd+bwd time (recomputation included)."""
    trees = list(trees) if trees is not None else candidate_trees(problem)
    if not trees:
        raise PlanError("no candidate contraction tree was found.")
    scored = []
    for tree in trees:
        plan = apply_memory(lower(problem, tree, needs_grad, itemsize, model=model), memory,
                            model)
        scored.append((plan.modelled_time(model, backward=any(needs_grad)), plan))
    scored.sort(key=lambda sp: sp[0])
    log.debug("scored %d candidate trees; best %.3g s", len(scored), scored[0][0])
    return Choice(scored[0][1], tuple((p.tree, t) for t, p in scored),
                  tuple(p for _, p in scored))


def sample_points(lo: int, hi: int, per_octave: int = 2) -> list[int]:
    """Geometric sample of integers in [lo, hi] (both ends included)."""
    pts = {lo, hi}
    if hi > lo:
        steps = max(1, int(per_octave * math.log2(hi / lo)))
        for k in range(steps + 1):
            pts.add(round(lo * (hi / lo) ** (k / steps)))
    return sorted(p for p in pts if lo <= p <= hi)
