"""Search contraction trees for a bound problem, and choose among them by modelled time.

Candidates come from exact search where the network is small (opt_einsum 'optimal', then 'dp'
minimising FLOPs and size), cotengra's hyper-optimizer beyond that, opt_einsum's greedy, and the
plain left-to-right order. Each candidate is lowered with its backward pass and scored by the
device model on forward + backward time, not forward FLOPs alone.

The exact searches are exponential in the number of operands, so they run against a time
budget (:mod:`~tncomp.compiler.budget`); when it is spent the greedy and left-to-right trees
(always candidates) are what remains, and the log says so. Whatever the device model says, a
candidate needing far more FLOPs or memory than another is never chosen (:func:`sound`), and
a tree read from the disk cache is re-scored the same way against a greedy tree
(:func:`implausible`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import opt_einsum

from tncomp.compiler.budget import Budget, OutOfBudget
from tncomp.compiler.chain import chain_trees
from tncomp.compiler.device_model import CPU_DEFAULT, DeviceModel
from tncomp.compiler.layouts import layout_greedy
from tncomp.compiler.memory import Memory, apply_memory
from tncomp.compiler.plan import Plan, lower, slot_elements
from tncomp.compiler.problem import Problem, Tree
from tncomp.errors import PlanError

log = logging.getLogger("tncomp.compiler.search")

EXACT_OPTIMAL_LIMIT = 5  # opt_einsum 'optimal' up to this many operands ('dp' is as exact)
EXACT_DP_LIMIT = 16  # opt_einsum 'dp' up to this many; cotengra beyond
OUTER_DP_LIMIT = 10  # 'dp' searches outer products up to this many operands (3^n subsets)
LAYOUT_GREEDY_LIMIT = 64  # layout_greedy (O(n^3) pair scores) up to this many operands
COTENGRA_MAX_S = 0.5  # cotengra's share of the budget (its greedy trials, then it stops)


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


def candidate_trees(problem: Problem, structured: bool = True,
                    budget: Budget | None = None) -> list[Tree]:
    """Distinct trees from several optimizers for a problem whose sizes are all ints.

    A chain network (a TT layer) gets the interval dynamic program of :mod:`chain` (polynomial
    time) in place of the exponential exact search, unless ``structured`` is False. The exact
    searches run against ``budget`` (default: a fresh :class:`~tncomp.compiler.budget.Budget`
    of ``$TNCOMP_PLAN_BUDGET_S`` seconds): one that runs out is dropped and logged, and the
    greedy and left-to-right trees are always among the candidates."""
    n = problem.n_leaves
    if n == 1:
        return [Tree(1, ())]
    budget = budget if budget is not None else Budget()
    inputs, output, sizes = _opt_inputs(problem)
    found: list[Tree] = []
    seen: set = set()

    def keep(tree: Tree) -> None:
        if tree.signature() not in seen:
            seen.add(tree.signature())
            found.append(tree)

    def add(path) -> None:
        keep(Tree.from_linear_path(n, path))

    chain = chain_trees(problem) if structured else None
    for tree in chain or ():
        keep(tree)
    if n <= EXACT_OPTIMAL_LIMIT:
        add(opt_einsum.paths.optimal(inputs, output, sizes))
    # on a chain the interval DP above replaces the exponential exact search
    if chain is None and n <= EXACT_DP_LIMIT:
        # Outer products only on small networks: with them the program visits every subset.
        searches = [("flops", True), ("size", True)] if n <= OUTER_DP_LIMIT else [("flops", False)]
        for minimize, outer in searches:
            what = f"dp ({minimize}{', outer products' if outer else ''})"
            path = None if budget.spent else _bounded_dp(inputs, output, sizes, minimize, outer,
                                                          budget)
            if path is None:
                budget.stopped(what, n)
            else:
                add(path)
    elif chain is None and budget.spent:
        budget.stopped("cotengra", n)
    elif chain is None:
        add(_cotengra_path(inputs, output, sizes, min(budget.remaining(), COTENGRA_MAX_S)))
    add(opt_einsum.paths.greedy(inputs, output, sizes))  # cheap: always a candidate
    if n <= LAYOUT_GREEDY_LIMIT:
        keep(layout_greedy(problem))  # the same, but avoiding copies
    keep(_sequential(n))
    return found


def _bounded_dp(inputs, output, sizes, minimize: str, outer: bool, budget: Budget):
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


def _cotengra_path(inputs, output, sizes, max_time: float):
    import cotengra  # imported lazily: it is slow to import and only large networks need it

    # greedy trials only (no subtree reconfiguration: at 64 operands one trial of it took 1 s)
    opt = cotengra.HyperOptimizer(max_repeats=64, max_time=max(max_time, 1e-3), progbar=False,
                                  minimize="flops", methods=["greedy"], parallel=False,
                                  reconf_opts=None)
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
    budget: Budget | None = None,
) -> Choice:
    """Lower every candidate tree under the memory mode and keep the one with the least
    modelled fwd+bwd time (recomputation included). The search for candidates and the
    orientation search of their lowering each run against a budget of
    ``$TNCOMP_PLAN_BUDGET_S`` seconds (``budget``, when given, bounds the lowering)."""
    trees = list(trees) if trees is not None else candidate_trees(problem)
    if not trees:
        raise PlanError("no candidate contraction tree was found.")
    budget = budget if budget is not None else Budget()
    plans = [apply_memory(lower(problem, tree, needs_grad, itemsize, model=model, budget=budget),
                          memory, model) for tree in trees]
    backward = any(needs_grad)
    scored = [(plan.modelled_time(model, backward=backward), plan)
              for plan, ok in zip(plans, sound(plans, problem), strict=True) if ok]
    if not scored:
        raise PlanError(f"none of {len(plans)} candidate trees could be scored (internal).")
    scored.sort(key=lambda sp: sp[0])
    scored = prefer_lean(scored, model)
    log.debug("scored %d candidate trees; best %.3g s", len(scored), scored[0][0])
    return Choice(scored[0][1], tuple((p.tree, t) for t, p in scored),
                  tuple(p for _, p in scored))


LEAN_FLOPS = 4.0  # a candidate needing this many times fewer FLOPs than the modelled best ...
LEAN_SLACK = 2.5  # ... and modelled at most this many times slower wins, on a model not measured


def prefer_lean(scored: list[tuple[float, Plan]], model: DeviceModel
                ) -> list[tuple[float, Plan]]:
    """``scored`` (modelled time, plan; best first) with the best replaced, when ``model`` is
    the CPU's default guess (:data:`~tncomp.compiler.device_model.CPU_DEFAULT`, not measured),
    by the fastest-modelled candidate that needs :data:`LEAN_FLOPS` times fewer FLOPs (forward
    + backward) and is modelled at most :data:`LEAN_SLACK` times slower.

    Why: an uncalibrated model guesses the GEMM rate and the bandwidth, and the guess of their
    ratio is what decides between a tree of few FLOPs and many copies and one of many FLOPs and
    few copies. One CPU thread runs GEMMs at a fraction of the default rate while it copies
    near the default bandwidth, so the guess favours FLOP-heavy trees there: it chose to rebuild
    a BTT layer's dense weight (8x the FLOPs of its block-by-block order, which ran faster). A
    measured model (``tncomp calibrate``) knows that ratio: its choice stands."""
    if len(scored) < 2 or model.source != CPU_DEFAULT.source:
        return scored
    best_time, best = scored[0]
    flops = lambda p: p.forward_flops + p.backward_flops  # noqa: E731
    lean = [(t, p) for t, p in scored[1:]
            if flops(p) * LEAN_FLOPS <= flops(best) and t <= LEAN_SLACK * best_time]
    if not lean:
        return scored
    log.debug("a tree of %d FLOP modelled %.2fx slower replaces one of %d FLOP (model not "
              "calibrated)", flops(lean[0][1]), lean[0][0] / best_time, flops(best))
    return [lean[0], *(tp for tp in scored if tp[1] is not lean[0][1])]


FAR_WORSE = 16.0  # the planner never chooses a tree needing this many times the best's
STORED_FAR_WORSE = 64.0  # a stored tree needing this many times a greedy tree's is rebuilt


def footprint(plan: Plan) -> tuple[int, int]:
    """``(fwd+bwd FLOPs, elements of the largest value the forward makes)`` of ``plan``: what
    a tree costs whatever the device model says (the GEMM orientations change neither)."""
    flops = sum(op.flops for op in (*plan.forward, *plan.backward))
    return flops, max(slot_elements(plan).values(), default=0)


def far_worse(this: tuple[int, int], best: tuple[int, int], floor: int = 1,
              factor: float = FAR_WORSE) -> str | None:
    """Why a tree of :func:`footprint` ``this`` is far worse than ``best`` (FLOPs, largest
    value), or None: more than ``factor`` times either. ``floor`` (the largest operand or
    output) keeps tiny values from counting."""
    (flops, largest), (best_flops, best_largest) = this, best
    if flops > factor * max(best_flops, floor):
        return f"{flops:.3g} FLOP, more than {factor:g}x {best_flops:.3g}"
    if largest > factor * max(best_largest, floor):
        return (f"an intermediate of {largest:.3g} elements, more than {factor:g}x "
                f"{max(best_largest, floor):.3g}")
    return None


def largest_operand(problem: Problem) -> int:
    """Elements of the largest operand or of the output (the floor of :func:`far_worse`)."""
    return max(int(problem.volume(t)) for t in (*problem.inputs, problem.output))


def sound(plans: Sequence[Plan], problem: Problem) -> list[bool]:
    """Which of several plans of one problem are not :func:`far_worse` than the least of them:
    whatever a device model (or a planted calibration) says, a tree needing 16x the FLOPs or
    memory of another candidate is not chosen. When every one is (the fewest FLOPs and the
    least memory far apart), those that no other beats on both count as sound: at least one
    always does."""
    feet = [footprint(p) for p in plans]
    best = (min(f for f, _ in feet), min(s for _, s in feet))
    floor = largest_operand(problem)
    ok = [far_worse(f, best, floor) is None for f in feet]
    if not any(ok):  # the least FLOPs and the least memory come at a far cost of each other:
        # keep the candidates no other beats on both
        ok = [not any(g[0] <= f[0] and g[1] <= f[1] and g != f for g in feet) for f in feet]
    return ok


def implausible(problem: Problem, tree: Tree, needs_grad: Sequence[bool],
                itemsize: int) -> str | None:
    """Why ``tree`` (read from the disk cache) should not be trusted, or None.

    Anyone who can write the cache folder can write a valid entry, so a stored tree is
    re-scored against a fresh greedy tree and refused when it is :func:`far_worse`: more than
    :data:`STORED_FAR_WORSE` times its FLOPs (fwd + bwd) or its largest intermediate. The
    planner never chooses a tree :data:`FAR_WORSE` times worse than another candidate
    (:func:`sound`), and a regime's tree is checked at the ends of its range, hence the wider
    margin; a planted tree that makes an intermediate of N^4 elements where greedy makes N^2
    is refused. Lowering is arithmetic only: no tensor is made, and the device model plays no
    part."""
    inputs, output, sizes = _opt_inputs(problem)
    greedy = Tree.from_linear_path(problem.n_leaves,
                                   opt_einsum.paths.greedy(inputs, output, sizes))
    if tree == greedy:
        return None
    stored, fresh = (footprint(lower(problem, t, needs_grad, itemsize,
                                     swaps=[False] * len(t.steps))) for t in (tree, greedy))
    why = far_worse(stored, fresh, largest_operand(problem), STORED_FAR_WORSE)
    return None if why is None else f"it needs {why} (a fresh greedy tree)"


def sample_points(lo: int, hi: int, per_octave: int = 2) -> list[int]:
    """Geometric sample of integers in [lo, hi] (both ends included)."""
    pts = {lo, hi}
    if hi > lo:
        steps = max(1, int(per_octave * math.log2(hi / lo)))
        for k in range(steps + 1):
            pts.add(round(lo * (hi / lo) ** (k / steps)))
    return sorted(p for p in pts if lo <= p <= hi)
