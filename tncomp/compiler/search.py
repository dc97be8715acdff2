"""Search contraction trees for a bound problem, and choose among them by modelled time.

Candidates come from the registered tree finders (:mod:`tncomp.compiler.finders`): exact
search where the network is small (opt_einsum 'optimal', then 'dp' minimising FLOPs and size),
cotengra's hyper-optimizer beyond that, opt_einsum's greedy, and the plain left-to-right order.
Each candidate is lowered with its backward pass and scored by the device model on forward +
backward time, not forward FLOPs alone.

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

from tncomp.compiler.budget import Budget
from tncomp.compiler.chain import chain_trees
from tncomp.compiler.device_model import CPU_DEFAULT, DeviceModel
from tncomp.compiler.finders import SearchSpace, tree_finders
from tncomp.compiler.finders.greedy import greedy_finder
from tncomp.compiler.memory import Memory, apply_memory
from tncomp.compiler.plan import Plan, lower, slot_elements
from tncomp.compiler.problem import Problem, Tree
from tncomp.errors import PlanError

log = logging.getLogger("tncomp.compiler.search")

def _space(problem: Problem, structured: bool, budget: Budget) -> SearchSpace:
    return SearchSpace(problem=problem,
                       inputs=tuple(frozenset(term) for term in problem.leaf_kept),
                       output=frozenset(problem.output),
                       sizes={i: int(s) for i, s in problem.size_dict.items()}, budget=budget,
                       chain=chain_trees(problem) if structured else None)


def candidate_trees(problem: Problem, structured: bool = True,
                    budget: Budget | None = None) -> list[Tree]:
    """Distinct trees of every registered finder (:mod:`tncomp.compiler.finders`, in their
    order) for a problem whose sizes are all ints.

    A chain network (a TT layer) gets the interval dynamic program of :mod:`chain` (polynomial
    time) in place of the exponential exact search, unless ``structured`` is False. The exact
    searches run against ``budget`` (default: a fresh :class:`~tncomp.compiler.budget.Budget`
    of ``$TNCOMP_PLAN_BUDGET_S`` seconds): one that runs out is dropped and logged, and the
    greedy and left-to-right trees are always among the candidates."""
    if problem.n_leaves == 1:
        return [Tree(1, ())]
    space = _space(problem, structured, budget if budget is not None else Budget())
    found: dict[tuple, Tree] = {}
    for finder in tree_finders().values():
        for tree in finder(space):
            found.setdefault(tree.signature(), tree)
    return list(found.values())


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
    (greedy,) = greedy_finder(_space(problem, False, Budget()))
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
