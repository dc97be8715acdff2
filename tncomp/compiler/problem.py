"""A network with its sizes chosen (ints or sympy symbols), and contraction trees over it.

A :class:`Problem` is what optimizers see: the index tuple of every operand after summing out
indices that no other tensor carries, the output, and a size per index. A :class:`Tree` is a
contraction order in SSA form: leaves ``0..n-1`` are the operands, step ``k`` makes node ``n+k``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import sympy

from tncomp.compiler.ir import Dim, Network
from tncomp.errors import CacheError, PlanError

SizeExpr = int | sympy.Expr


@dataclass(frozen=True)
class Problem:
    """Operand indices, output indices and sizes; ``leaf_kept[k]`` survives leaf reductions."""

    inputs: tuple[tuple[str, ...], ...]
    output: tuple[str, ...]
    size_dict: Mapping[str, SizeExpr]

    @cached_property
    def leaf_kept(self) -> tuple[tuple[str, ...], ...]:
        counts = Counter(i for term in self.inputs for i in term)
        keep = set(self.output)
        return tuple(
            tuple(i for i in term if counts[i] > 1 or i in keep) for term in self.inputs
        )

    @property
    def n_leaves(self) -> int:
        """Number of operands (the leaves of a contraction tree)."""
        return len(self.inputs)

    def volume(self, indices) -> SizeExpr:
        """Product of the sizes of ``indices`` (1 for none): the element count over them."""
        vol: SizeExpr = 1
        for i in indices:
            vol = vol * self.size_dict[i]
        return vol

    def kept_after(self, covered: frozenset[int]) -> tuple[str, ...]:
        """Indices a node over the leaves ``covered`` keeps: those needed outside it."""
        holders, output = self._holders
        seen: dict[str, None] = {}
        for k in sorted(covered):
            for i in self.leaf_kept[k]:
                if i in output or not holders[i] <= covered:
                    seen.setdefault(i)
        return tuple(seen)

    @cached_property
    def _holders(self) -> tuple[dict[str, frozenset[int]], frozenset[str]]:
        """The leaves holding each kept index, and the output's indices (for kept_after)."""
        holders: dict[str, set[int]] = {}
        for k, term in enumerate(self.leaf_kept):
            for i in term:
                holders.setdefault(i, set()).add(k)
        return {i: frozenset(h) for i, h in holders.items()}, frozenset(self.output)


def problem_for(net: Network, sizes: Mapping[str, int] | None = None) -> Problem:
    """The problem of ``net`` with bound sizes where given and sympy symbols elsewhere."""
    size_dict: dict[str, SizeExpr] = {}
    for index, size in net.sizes:
        if sizes is not None and index in sizes:
            size_dict[index] = int(sizes[index])
        elif isinstance(size, Dim):
            size_dict[index] = size.symbol
        else:
            size_dict[index] = size
    return Problem(
        inputs=tuple(t.indices for t in net.operands),
        output=net.output.indices,
        size_dict=size_dict,
    )


@dataclass(frozen=True, slots=True)
class Tree:
    """A contraction order in SSA form; ``steps[k] = (a, b)`` contracts nodes a and b."""

    n_leaves: int
    steps: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if len(self.steps) != max(self.n_leaves - 1, 0):
            raise PlanError(
                f"a tree over {self.n_leaves} leaves needs {self.n_leaves - 1} steps, "
                f"got {len(self.steps)}."
            )
        used: set[int] = set()
        for k, (a, b) in enumerate(self.steps):
            limit = self.n_leaves + k
            for node in (a, b):
                if not 0 <= node < limit or node in used:
                    raise PlanError(f"step {k} of the tree uses node {node} invalidly.")
                used.add(node)

    @property
    def root(self) -> int:
        """Node id of the final contraction (0 for a single leaf)."""
        return self.n_leaves + len(self.steps) - 1 if self.steps else 0

    def leaves_under(self) -> list[frozenset[int]]:
        """For every node (leaves, then steps), the set of leaves below it."""
        covers = [frozenset({k}) for k in range(self.n_leaves)]
        for a, b in self.steps:
            covers.append(covers[a] | covers[b])
        return covers

    @classmethod
    def from_linear_path(cls, n_leaves: int, path) -> Tree:
        """From an opt_einsum-style linear path (positions in a shrinking list)."""
        live = list(range(n_leaves))
        steps = []
        next_id = n_leaves
        for pair in path:
            if len(pair) == 1:
                continue
            if len(pair) != 2:
                raise PlanError(f"path step {pair} contracts {len(pair)} tensors; need pairs.")
            i, j = sorted(pair)
            b, a = live.pop(j), live.pop(i)
            steps.append((a, b))
            live.append(next_id)
            next_id += 1
        while len(live) > 1:  # an incomplete path: finish left to right
            a, b = live.pop(0), live.pop(0)
            steps.append((a, b))
            live.append(next_id)
            next_id += 1
        return cls(n_leaves, tuple(steps))

    def signature(self) -> frozenset:
        """The set of pairwise contractions (as pairs of leaf sets): trees equal under it do the
        same work, only in another order."""
        covers = self.leaves_under()
        return frozenset(frozenset((covers[a], covers[b])) for a, b in self.steps)

    def to_payload(self) -> dict:
        """A JSON-able form (for the disk cache): ``{"n": n_leaves, "steps": [[a, b], ...]}``."""
        return {"n": self.n_leaves, "steps": [[a, b] for a, b in self.steps]}

    @classmethod
    def from_payload(cls, payload: object, n_leaves: int | None = None) -> Tree:
        """The tree :meth:`to_payload` wrote, checked: a :class:`CacheError` saying what is wrong
        when ``payload`` is not a tree (over ``n_leaves`` leaves, when given)."""
        if not isinstance(payload, dict) or not {"n", "steps"} <= set(payload):
            raise CacheError(f"a stored tree is {_short(payload)}; expected {{'n': ..., "
                             "'steps': [[a, b], ...]}.")
        n, steps = payload["n"], payload["steps"]
        if not _is_int(n) or n < 1:
            raise CacheError(f"a stored tree has n={_short(n)}; expected an int >= 1.")
        if n_leaves is not None and n != n_leaves:
            raise CacheError(f"a stored tree is over {n} leaves; the network has {n_leaves}.")
        if not isinstance(steps, list) or not all(
                isinstance(s, list) and len(s) == 2 and all(map(_is_int, s)) for s in steps):
            raise CacheError(f"a stored tree has steps {_short(steps)}; expected a list of "
                             "[int, int] pairs.")
        try:
            return cls(n, tuple((a, b) for a, b in steps))
        except PlanError as exc:
            raise CacheError(f"a stored tree is invalid: {exc}") from None

    def to_linear_path(self) -> list[tuple[int, int]]:
        """The opt_einsum-style linear path of this tree (positions in a shrinking list, each result
        appended last): the inverse of :meth:`from_linear_path`."""
        live = list(range(self.n_leaves))
        path = []
        for k, (a, b) in enumerate(self.steps):
            i, j = live.index(a), live.index(b)
            path.append((min(i, j), max(i, j)))
            for pos in sorted((i, j), reverse=True):
                live.pop(pos)
            live.append(self.n_leaves + k)
        return path


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: object, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."
