"""Costs of a contraction tree, forward and backward, as formulas in the symbolic sizes.

The backward pass is the reversed tree: for a step ``c = a . b`` the adjoint of ``a`` is
``dc . b`` and that of ``b`` is ``dc . a``. Every gradient network (the network minus one
operand, plus dY) is thereby contracted along the same tree, reusing forward intermediates and
sharing the adjoints of common sub-trees between gradients. FLOPs count 2 per multiply-add.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sympy

from tncomp.compiler.problem import Problem, SizeExpr, Tree


@dataclass(frozen=True)
class StepInfo:
    """One pairwise contraction: the node ids, the kept indices and the FLOPs of one GEMM."""

    left: int
    right: int
    node: int
    indices: tuple[str, ...]
    flops: SizeExpr
    adjoint_left: bool
    adjoint_right: bool


@dataclass(frozen=True)
class Costs:
    """Forward/backward FLOPs and bytes, and memory, of one tree (ints or sympy expressions)."""

    forward_flops: SizeExpr
    backward_flops: SizeExpr
    forward_bytes: SizeExpr
    backward_bytes: SizeExpr
    saved_bytes: SizeExpr
    peak_bytes: SizeExpr

    @property
    def total_flops(self) -> SizeExpr:
        """Forward plus backward FLOPs."""
        return self.forward_flops + self.backward_flops

    @property
    def total_bytes(self) -> SizeExpr:
        """Forward plus backward bytes moved."""
        return self.forward_bytes + self.backward_bytes

    def subs(self, values: dict) -> Costs:
        """Substitute symbol values (``{B: 4096}`` or ``{'B': 4096}``) into every formula."""
        def sub(e):
            if isinstance(e, sympy.Expr):
                mapping = {(sympy.Symbol(k, positive=True, integer=True) if isinstance(k, str)
                            else k): v for k, v in values.items()}
                e = e.subs(mapping)
                return int(e) if e.is_Integer else e
            return e

        return Costs(*(sub(getattr(self, f)) for f in self.__dataclass_fields__))


def node_indices(problem: Problem, tree: Tree) -> list[tuple[str, ...]]:
    """Kept indices of every node (leaves after reduction, then each step's result)."""
    covers = tree.leaves_under()
    return [problem.leaf_kept[k] for k in range(tree.n_leaves)] + [
        problem.kept_after(covers[tree.n_leaves + k]) for k in range(len(tree.steps))
    ]


def adjoint_nodes(tree: Tree, needs_grad: Sequence[bool]) -> list[bool]:
    """Whether each node needs an adjoint: some leaf below it needs a gradient."""
    return [any(needs_grad[k] for k in cover) for cover in tree.leaves_under()]


def step_infos(problem: Problem, tree: Tree, needs_grad: Sequence[bool]) -> list[StepInfo]:
    indices = node_indices(problem, tree)
    adj = adjoint_nodes(tree, needs_grad)
    infos = []
    for k, (a, b) in enumerate(tree.steps):
        union = tuple(dict.fromkeys(indices[a] + indices[b]))
        infos.append(
            StepInfo(a, b, tree.n_leaves + k, union, 2 * problem.volume(union), adj[a], adj[b])
        )
    return infos


def _max(values: list[SizeExpr]) -> SizeExpr:
    if all(isinstance(v, int) for v in values):
        return max(values)
    return sympy.Max(*values)


def tree_costs(
    problem: Problem, tree: Tree, needs_grad: Sequence[bool], itemsize: int = 4
) -> Costs:
    """FLOPs, bytes and memory of the forward pass and the reversed-tree backward pass.

    Memory counts intermediates and the output (the caller holds the operands): the forward
    peak, the forward intermediates saved for the backward pass, and the backward peak.
    """
    indices = node_indices(problem, tree)
    size = [problem.volume(ix) * itemsize for ix in indices]
    leaf_size = [problem.volume(term) * itemsize for term in problem.inputs]
    infos = step_infos(problem, tree, needs_grad)
    adj = adjoint_nodes(tree, needs_grad)
    n = tree.n_leaves

    fwd_flops: SizeExpr = 0
    fwd_bytes: SizeExpr = 0
    bwd_flops: SizeExpr = 0
    bwd_bytes: SizeExpr = 0
    for k, term in enumerate(problem.inputs):  # leaf reductions (sums over lone indices)
        summed = [i for i in term if i not in problem.leaf_kept[k]]
        if any(problem.size_dict[i] != 1 for i in summed):  # size-1 ends are free reshapes
            fwd_flops += problem.volume(term)
            fwd_bytes += leaf_size[k] + size[k]
            if needs_grad[k]:
                bwd_bytes += leaf_size[k] + size[k]
    saved: set[int] = set()
    for s in infos:
        fwd_flops += s.flops
        fwd_bytes += size[s.left] + size[s.right] + size[s.node]
        for needed, this, other in ((s.adjoint_left, s.left, s.right),
                                    (s.adjoint_right, s.right, s.left)):
            if needed:
                bwd_flops += s.flops
                bwd_bytes += size[s.node] + size[other] + size[this]
                saved.add(other)

    # Forward peak: intermediates live from creation to last use, or to the backward if saved.
    live: dict[int, SizeExpr] = {}
    points: list[SizeExpr] = [0]
    for s in infos:
        live[s.node] = size[s.node]
        points.append(sum(live.values()))
        for child in (s.left, s.right):
            if child >= n and child not in saved:
                live.pop(child, None)
    saved_bytes = sum((size[c] for c in saved if c >= n), start=0)
    # Backward peak: saved values + the adjoints in flight, walking the steps in reverse.
    adjoints: dict[int, SizeExpr] = {tree.root: size[tree.root]} if infos else {}
    for s in reversed(infos):
        for needed, this in ((s.adjoint_left, s.left), (s.adjoint_right, s.right)):
            if needed:
                adjoints[this] = size[this]
        points.append(sum(live.values()) + sum(adjoints.values()))
        adjoints.pop(s.node, None)
        for child in (s.left, s.right):
            if child >= n:
                live.pop(child, None)
        for child in (s.left, s.right):
            if child < n and not adj[child]:
                adjoints.pop(child, None)
    return Costs(
        forward_flops=fwd_flops,
        backward_flops=bwd_flops,
        forward_bytes=fwd_bytes,
        backward_bytes=bwd_bytes,
        saved_bytes=saved_bytes,
        peak_bytes=_max(points),
    )
