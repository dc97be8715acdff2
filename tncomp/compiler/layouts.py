"""Layouts: when a GEMM reads a value in place, and a tree built so that it can.

Every value of a plan lives contiguous in one index order, its *layout*. A pairwise contraction
is one (batched) GEMM over views of its two operands when each operand stores its batch, free
and contracted indices as three adjacent groups (:func:`split`) whose batch and contracted
orders agree with the other operand's. The batch group may sit first or between the other two
(a strided batch: the matrices keep a unit stride, so BLAS reads them in place); only a batch
group stored innermost leaves no matrix to read. Otherwise one operand is copied first
(:func:`pair` says which, and the lowering emits the permute).

FLOP-optimal trees often contract a large value over a middle index, which needs such a copy,
where another order of the same contractions needs none: a Tucker layer contracting x's
innermost mode first (and storing each result so the next mode is outermost or innermost)
runs without a single copy. :func:`layout_greedy` builds that tree: opt_einsum's greedy rule
(the contraction that shrinks the live values most) with the bytes a step must copy counted as
a cost, each intermediate keeping both of its possible layouts until a step reads it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tncomp.compiler.ops import MatView, Permute
from tncomp.compiler.problem import Problem, Tree

__all__ = ["COPY_WEIGHT", "Pairing", "layout_greedy", "matrix_view", "pair", "permute_op",
           "split"]

COPY_WEIGHT = 2.0  # layout_greedy: a copied element costs a read and a write


def _runs(layout: Sequence[str], groups: Sequence[set[str]]) -> list[int] | None:
    """The group of each run of ``layout`` (one run per group), or None when a group's indices
    are not adjacent."""
    runs: list[int] = []
    for i in layout:
        g = next(k for k, group in enumerate(groups) if i in group)
        if not runs or runs[-1] != g:
            if g in runs:
                return None
            runs.append(g)
    return runs


def split(layout: Sequence[str], batch: set[str], free: set[str], contr: set[str],
          ) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] | None:
    """``(batch order, free order, contracted order)`` as ``layout`` stores them, if it stores
    each group adjacent and a matrix view of it exists (:func:`matrix_view`: the batch group
    first, or between the other two), else None."""
    runs = _runs(layout, (batch, free, contr))
    if runs is None or (len(runs) > 1 and runs[-1] == 0):  # batch innermost: no unit stride
        return None
    b, f, c = (tuple(i for i in layout if i in g) for g in (batch, free, contr))
    return b, f, c


def matrix_view(slot: int, layout: Sequence[str], sizes: Mapping[str, int],
                bo: Sequence[str], ro: Sequence[str], co: Sequence[str]) -> MatView | None:
    """The value ``(slot, layout)`` read as the batched matrix ``(bo; ro x co)`` (each group
    in exactly that index order) without a copy, or None. ``layout`` must be the groups
    concatenated as ``bo ro co``, ``bo co ro`` (transposed), ``ro bo co`` or ``co bo ro`` (a
    strided batch, :attr:`MatView.batch_axis` 1)."""
    layout = tuple(layout)
    nb, nr, nc = (math.prod(sizes[i] for i in ix) for ix in (bo, ro, co))
    lead = (nb,) if bo else ()
    if layout == (*bo, *ro, *co):
        return MatView(slot, (*lead, nr, nc), False)
    if layout == (*bo, *co, *ro):
        return MatView(slot, (*lead, nc, nr), True)
    if bo and layout == (*ro, *bo, *co):
        return MatView(slot, (nr, nb, nc), False, 1)
    if bo and layout == (*co, *bo, *ro):
        return MatView(slot, (nc, nb, nr), True, 1)
    return None


def permute_op(dst: int, src: int, layout: Sequence[str], target: Sequence[str],
               sizes: Mapping[str, int], itemsize: int, note: str = "") -> Permute:
    """The copy of the value ``(src, layout)`` into slot ``dst`` in the index order
    ``target`` (its bytes: one read and one write)."""
    perm = tuple(tuple(layout).index(i) for i in target)
    return Permute(dst, src, tuple(sizes[i] for i in layout), perm,
                   2 * math.prod(sizes[i] for i in target) * itemsize, note)


@dataclass(frozen=True)
class Pairing:
    """How one contraction reads its two operands: the GEMM's batch, contracted and free index
    orders, and which operand must be copied into ``(batch, free, contracted)`` first."""

    bo: tuple[str, ...]
    ko: tuple[str, ...]
    fo_a: tuple[str, ...]
    fo_b: tuple[str, ...]
    copy_a: bool
    copy_b: bool

    def result_layouts(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The result's layout as written, and swapped (the other GEMM orientation)."""
        return (*self.bo, *self.fo_a, *self.fo_b), (*self.bo, *self.fo_b, *self.fo_a)


def pair(a: Sequence[str], b: Sequence[str], kept: set[str],
         sizes: Mapping[str, int]) -> Pairing:
    """The GEMM contracting the values of layouts ``a`` and ``b`` (their non-unit indices)
    into the non-unit ``kept`` indices: the batch and contracted orders of whichever operand
    stores them readably (the one whose copy would cost more, when both do), the other
    operand copied when its orders differ."""
    ia, ib = set(a), set(b)
    batch = ia & ib & kept
    contr = (ia & ib) - kept
    fa, fb = ia - ib, ib - ia
    sa, sb = split(a, batch, fa, contr), split(b, batch, fb, contr)
    options = [(s[0], s[2]) for s in (sa, sb) if s]
    options.append((tuple(i for i in a if i in batch), tuple(i for i in a if i in contr)))

    def copies(opt: tuple[tuple[str, ...], tuple[str, ...]]) -> int:
        return sum(math.prod(sizes[i] for i in v) for s, v in ((sa, a), (sb, b))
                   if not (s and (s[0], s[2]) == opt))

    bo, ko = min(options, key=copies)
    fo_a = sa[1] if sa else tuple(i for i in a if i in fa)
    fo_b = sb[1] if sb else tuple(i for i in b if i in fb)
    return Pairing(bo, ko, fo_a, fo_b, not (sa and (sa[0], sa[2]) == (bo, ko)),
                   not (sb and (sb[0], sb[2]) == (bo, ko)))


def layout_greedy(problem: Problem, copy_weight: float = COPY_WEIGHT) -> Tree:
    """A tree of ``problem`` (bound sizes) whose steps avoid copies: repeatedly the pair of
    live values, sharing an index where any do, with the least ``size(result) - size(a) -
    size(b) + copy_weight * elements copied``, each intermediate readable in either of its two
    layouts (:meth:`Pairing.result_layouts`)."""
    n = problem.n_leaves
    sizes = problem.size_dict
    nonunit = lambda ix: tuple(i for i in ix if sizes[i] != 1)  # noqa: E731
    vol = lambda ix: math.prod(sizes[i] for i in ix)  # noqa: E731
    live: dict[int, tuple[frozenset[int], tuple[tuple[str, ...], ...]]] = {
        k: (frozenset({k}), (nonunit(problem.leaf_kept[k]),)) for k in range(n)}
    steps: list[tuple[int, int]] = []

    def score(u: int, v: int) -> tuple[float, tuple[tuple[str, ...], ...]]:
        cover = live[u][0] | live[v][0]
        kept = set(nonunit(problem.kept_after(cover)))
        best = None
        for la in live[u][1]:
            for lb in live[v][1]:
                p = pair(la, lb, kept, sizes)
                copied = vol(la) * p.copy_a + vol(lb) * p.copy_b
                if best is None or copied < best[0]:
                    best = (copied, p)
        copied, p = best
        out = p.result_layouts()
        grow = vol(out[0]) - vol(live[u][1][0]) - vol(live[v][1][0])
        return grow + copy_weight * copied, out

    while len(live) > 1:
        ids = sorted(live)
        indices = {k: {i for lay in live[k][1][:1] for i in lay} for k in ids}
        pairs = [(u, v) for x, u in enumerate(ids) for v in ids[x + 1:]
                 if indices[u] & indices[v]]
        if not pairs:  # disconnected: an outer product of the two smallest
            u, v = sorted(ids, key=lambda k: vol(live[k][1][0]))[:2]
            pairs = [(min(u, v), max(u, v))]
        scored = [(score(u, v), u, v) for u, v in pairs]
        (_, layouts), u, v = min(scored, key=lambda s: (s[0][0], s[1], s[2]))
        steps.append((u, v))
        node = n + len(steps) - 1
        live[node] = (live[u][0] | live[v][0], tuple(dict.fromkeys(layouts)))
        del live[u], live[v]
    return Tree(n, tuple(steps))
