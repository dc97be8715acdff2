"""Batch-size regimes: which plan is fastest for which range of one symbolic size.

The best order changes with the batch: for a TT layer, small batches contract x core by core
while large ones first merge the input-side and output-side cores into two factors. Candidate
trees are searched at sampled sizes once; each is modelled as a function of the size, and the
exact integer breakpoints where the best candidate changes are found by bisection. At call time
the concrete size picks its regime without searching again.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tncomp.compiler.budget import Budget
from tncomp.compiler.device_model import DeviceModel
from tncomp.compiler.ir import Dim, Network, bind_dims
from tncomp.compiler.memory import Memory, apply_memory
from tncomp.compiler.plan import lower
from tncomp.compiler.problem import Tree, problem_for
from tncomp.compiler.search import candidate_trees, prefer_lean, sample_points, sound
from tncomp.errors import CacheError

DEFAULT_MAX = 1 << 20  # upper end of the search for an unbounded Dim
ORIENT_AT = 4096  # the size each candidate's GEMM orientations are chosen at (a training batch)


@dataclass(frozen=True)
class Regime:
    """Sizes ``lo..hi`` (inclusive) of the symbol use ``tree``."""

    lo: int
    hi: int
    tree: Tree


@dataclass(frozen=True)
class RegimeTable:
    """Regimes covering the bounds of one symbolic size, in increasing order."""

    dim: Dim
    regimes: tuple[Regime, ...]

    def tree_for(self, value: int) -> Tree:
        starts = [r.lo for r in self.regimes]
        pos = max(bisect_right(starts, value) - 1, 0)
        return self.regimes[pos].tree

    @property
    def breakpoints(self) -> tuple[int, ...]:
        """The sizes at which a new regime starts."""
        return tuple(r.lo for r in self.regimes[1:])


def upper_bound(dim: Dim) -> int:
    """The largest size the regime search covers: ``dim.max``, or 2**20 when unbounded."""
    return dim.max if dim.max is not None else max(DEFAULT_MAX, dim.min)


def regime_candidates(net: Network, needs_grad: Sequence[bool], itemsize: int,
                      model: DeviceModel) -> list[tuple[Tree, tuple[bool, ...]]]:
    """The trees the regime search compares and the GEMM orientations each is scored with:
    candidates at sizes sampled over the one symbol's bounds, each oriented at a training-sized
    batch (:data:`ORIENT_AT`, within the bounds): orientations chosen where a tree was first
    found (often batch 1) can be far off where the time goes (a BTT layer's block order,
    oriented as at batch 1, was modelled 3.8x slower at batch 2048 than in its own
    orientations, and lost to rebuilding the dense weight).
    The samples share one search budget and one lowering budget (see
    :mod:`~tncomp.compiler.budget`): a large network gets greedy candidates once they are spent."""
    (dim,) = net.dims
    found: list[tuple[Tree, tuple[bool, ...]]] = []
    seen: set = set()
    search, lowering = Budget(), Budget()
    anchor = problem_for(net, bind_dims(net, min(max(ORIENT_AT, dim.min), upper_bound(dim))))
    for value in sample_points(dim.min, upper_bound(dim), 1):
        problem = problem_for(net, bind_dims(net, value))
        for tree in candidate_trees(problem, budget=search):
            if tree.signature() not in seen:
                seen.add(tree.signature())
                found.append((tree, lower(anchor, tree, needs_grad, itemsize, model=model,
                                          budget=lowering).swaps))
    return found


def build_regimes(
    net: Network,
    needs_grad: Sequence[bool],
    itemsize: int,
    model: DeviceModel,
    memory: Memory = "fast",
) -> RegimeTable:
    """Search candidates at sampled sizes of the network's one Dim; bisect the breakpoints.
    Candidates are timed under the memory mode (recomputation included)."""
    (dim,) = net.dims
    samples = sample_points(dim.min, upper_bound(dim), 1)
    candidates = regime_candidates(net, needs_grad, itemsize, model)
    with_grad = any(needs_grad)

    def best_at(value: int) -> int:
        problem = problem_for(net, bind_dims(net, value))
        plans = [apply_memory(lower(problem, t, needs_grad, itemsize, swaps=sw), memory, model)
                 for t, sw in candidates]
        ok = sound(plans, problem)  # never a far worse tree, whatever the model says
        scored = sorted(((p.modelled_time(model, with_grad), k) for k, (p, good)
                         in enumerate(zip(plans, ok, strict=True)) if good))
        # the same choice as choose_plan's among the modelled times (prefer_lean)
        chosen = prefer_lean([(t, plans[k]) for t, k in scored], model)[0][1]
        return next(k for k, p in enumerate(plans) if p is chosen)

    winners = [best_at(v) for v in samples]
    regimes: list[Regime] = []
    start, current = samples[0], winners[0]
    for k in range(1, len(samples)):
        lo, v1, w1 = samples[k - 1], samples[k], winners[k]
        # Between two samples the winner may change more than once (A, then B at the first
        # edge, then C by the next sample): bisect again from each edge until the regime's
        # tree is the next sample's winner.
        while w1 != current:
            edge = _bisect(lo, v1, current, best_at)
            regimes.append(Regime(start, edge - 1, candidates[current][0]))
            start, current, lo = edge, best_at(edge), edge
    regimes.append(Regime(start, samples[-1], candidates[current][0]))
    return RegimeTable(dim, tuple(_merge(regimes)))


def _bisect(lo: int, hi: int, winner_lo: int, best_at: Callable[[int], int]) -> int:
    """Smallest size in (lo, hi] whose winner differs from ``winner_lo``."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if best_at(mid) == winner_lo:
            lo = mid
        else:
            hi = mid
    return hi


def _merge(regimes: list[Regime]) -> list[Regime]:
    merged: list[Regime] = []
    for r in regimes:
        if merged and merged[-1].tree == r.tree:
            merged[-1] = Regime(merged[-1].lo, r.hi, r.tree)
        else:
            merged.append(r)
    return merged


def regimes_to_payload(table: RegimeTable) -> dict:
    """A JSON-able form for the disk cache."""
    return {"regimes": [{"lo": r.lo, "hi": r.hi, "tree": r.tree.to_payload()}
                        for r in table.regimes]}


def regimes_from_payload(dim: Dim, payload: object, n_leaves: int) -> RegimeTable:
    """The table :func:`regimes_to_payload` wrote for ``dim``, checked: a :class:`CacheError`
    saying what is wrong unless it holds regimes that cover ``dim``'s bounds without gap or
    overlap, each with a tree over ``n_leaves`` leaves."""
    entries = payload.get("regimes") if isinstance(payload, dict) else None
    if not isinstance(entries, list) or not entries:
        raise CacheError("a stored regime table holds no list of regimes.")
    regimes = []
    expected_lo = dim.min
    for k, entry in enumerate(entries):
        if not isinstance(entry, dict) or not {"lo", "hi", "tree"} <= set(entry):
            raise CacheError(f"regime {k} of a stored table is {entry!r:.60}; expected "
                             "{'lo': ..., 'hi': ..., 'tree': ...}.")
        lo, hi = entry["lo"], entry["hi"]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)):
            raise CacheError(f"regime {k} of a stored table has lo={lo!r}, hi={hi!r}; expected "
                             "ints.")
        if lo != expected_lo or hi < lo:
            raise CacheError(f"regime {k} of a stored table covers {lo}..{hi}; expected a range "
                             f"starting at {expected_lo}.")
        regimes.append(Regime(lo, hi, Tree.from_payload(entry["tree"], n_leaves)))
        expected_lo = hi + 1
    if regimes[-1].hi != upper_bound(dim):
        raise CacheError(f"a stored regime table ends at {regimes[-1].hi}; {dim.name}'s bounds "
                         f"end at {upper_bound(dim)}.")
    return RegimeTable(dim, tuple(regimes))
