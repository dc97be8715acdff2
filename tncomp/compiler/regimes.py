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

from tncomp.compiler.device_model import DeviceModel
from tncomp.compiler.ir import Dim, Network
from tncomp.compiler.plan import lower
from tncomp.compiler.problem import Tree, problem_for
from tncomp.compiler.search import candidate_trees, sample_points

DEFAULT_MAX = 1 << 20  # upper end of the search for an unbounded Dim


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


def _bind_single(net: Network, dim: Dim, value: int) -> dict[str, int]:
    out = {}
    for index, size in net.sizes:
        out[index] = value if isinstance(size, Dim) and size.name == dim.name else size
    return out


def build_regimes(
    net: Network,
    needs_grad: Sequence[bool],
    itemsize: int,
    model: DeviceModel,
    per_octave: int = 1,
) -> RegimeTable:
    """Search candidates at sampled sizes of the network's one Dim; bisect the breakpoints."""
    (dim,) = net.dims
    lo, hi = dim.min, dim.max if dim.max is not None else max(DEFAULT_MAX, dim.min)
    samples = sample_points(lo, hi, per_octave)
    trees: list[Tree] = []
    swaps: list[tuple[bool, ...]] = []  # each tree's GEMM orientations, fixed where it was found
    for value in samples:
        problem = problem_for(net, _bind_single(net, dim, value))
        for tree in candidate_trees(problem):
            if tree.signature() not in {t.signature() for t in trees}:
                trees.append(tree)
                swaps.append(lower(problem, tree, needs_grad, itemsize, model=model).swaps)
    with_grad = any(needs_grad)

    def best_at(value: int) -> int:
        problem = problem_for(net, _bind_single(net, dim, value))
        times = [
            lower(problem, t, needs_grad, itemsize, swaps=sw).modelled_time(model, with_grad)
            for t, sw in zip(trees, swaps, strict=True)
        ]
        return min(range(len(trees)), key=times.__getitem__)

    winners = [best_at(v) for v in samples]
    regimes: list[Regime] = []
    start, current = samples[0], winners[0]
    for k in range(1, len(samples)):
        v0, w0, v1, w1 = samples[k - 1], winners[k - 1], samples[k], winners[k]
        if w1 != w0:
            edge = _bisect(v0, v1, w0, best_at)
            regimes.append(Regime(start, edge - 1, trees[current]))
            start, current = edge, best_at(edge)
    regimes.append(Regime(start, hi, trees[current]))
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
    return {"regimes": [[r.lo, r.hi, r.tree.n_leaves, [list(s) for s in r.tree.steps]]
                        for r in table.regimes]}


def regimes_from_payload(dim: Dim, payload: dict) -> RegimeTable | None:
    try:
        regimes = tuple(Regime(lo, hi, Tree(n, tuple(tuple(s) for s in steps)))
                        for lo, hi, n, steps in payload["regimes"])
    except (KeyError, TypeError, ValueError):
        return None
    return RegimeTable(dim, regimes)
