"""The orientation of every step's result, chosen by a dynamic program over the tree.

A step's GEMM writes its result as ``(batch, free of a, free of b)`` or swapped, ``(batch, free
of b, free of a)`` (the other GEMM orientation, at no cost of its own). The choice decides
whether the step that reads the result, and the backward steps that read its adjoint, can do so
through a view or need a copy (:mod:`~tncomp.compiler.layouts`). Choosing step by step misses
plans where every choice only pays off together (a Tucker layer rotating each contracted mode to
the far end, so that the next one is outermost), and so did the coordinate descent that came
before.

Given the layouts of its two operands, a step's modelled time (its copies, its GEMM, the GEMMs
of its backward and the copies of its operands' adjoints) depends on nothing else. So each node
keeps, for every layout its value can have, the least modelled time of its subtree, and a step
combines its children's tables: exact for the costs it models, up to keeping the
:data:`KEEP` cheapest layouts of each node (a node has at most a few). The root adds the copy
into the output's layout and the reading of dY.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tncomp.compiler.cost import adjoint_nodes
from tncomp.compiler.device_model import DeviceModel
from tncomp.compiler.layouts import matrix_view, pair, permute_op
from tncomp.compiler.ops import MatMul
from tncomp.compiler.problem import Problem, Tree

KEEP = 8  # layouts kept per node (the cheapest)

Layout = tuple[str, ...]
Record = tuple[Layout, Layout, Layout]  # (batch, free of a, free of b) of the step making a value


@dataclass(frozen=True)
class _State:
    cost: float
    swaps: tuple[tuple[int, bool], ...]  # (step, swap) of every step below
    record: Record | None  # None for a leaf


def orientations(problem: Problem, tree: Tree, needs_grad: Sequence[bool], itemsize: int,
                 model: DeviceModel) -> tuple[bool, ...]:
    """``swaps[k]`` for every step of ``tree`` (bound sizes): the orientations with the least
    modelled forward + backward time of copies and GEMMs under ``model``."""
    n = tree.n_leaves
    if not tree.steps:
        return ()
    sizes = problem.size_dict

    def nonunit(indices) -> Layout:
        return tuple(i for i in indices if sizes[i] != 1)

    def copy_time(layout: Layout, target: Layout) -> float:
        return model.step_time(permute_op(0, 0, layout, target, sizes, itemsize))

    adj = adjoint_nodes(tree, needs_grad)
    covers = tree.leaves_under()
    tables: list[dict[Layout, _State]] = [
        {nonunit(problem.leaf_kept[k]): _State(0.0, (), None)} for k in range(n)]

    def adjoint_copy(node: int, layout: Layout, state: _State, stored: Layout,
                     bo: Layout) -> float:
        """The copy the adjoint of ``node`` (value layout ``layout``, read by its consumer as
        ``stored`` with batch ``bo``) needs before its own step (or its gradient) reads it."""
        written = (*bo, *(i for i in stored if i not in bo))
        if not adj[node]:
            return 0.0
        if state.record is None:  # a leaf: the gradient must come back in its layout
            return 0.0 if written == layout else copy_time(written, layout)
        if matrix_view(0, written, sizes, *state.record) is not None:
            return 0.0
        return copy_time(written, layout)

    for k, (a, b) in enumerate(tree.steps):
        node = n + k
        kept = set(nonunit(problem.kept_after(covers[node])))
        table: dict[Layout, _State] = {}
        for la, sa in tables[a].items():
            for lb, sb in tables[b].items():
                how = pair(la, lb, kept, sizes)
                bo, ko = how.bo, how.ko
                stored_a = (*bo, *how.fo_a, *ko) if how.copy_a else la
                stored_b = (*bo, *ko, *how.fo_b) if how.copy_b else lb
                cost = sa.cost + sb.cost
                cost += copy_time(la, stored_a) if how.copy_a else 0.0
                cost += copy_time(lb, stored_b) if how.copy_b else 0.0
                va = matrix_view(0, stored_a, sizes, bo, how.fo_a, ko)
                vb = matrix_view(1, stored_b, sizes, bo, ko, how.fo_b)
                if adj[node]:  # the backward: an adjoint GEMM per operand, and their layouts
                    cost += adjoint_copy(a, la, sa, stored_a, bo)
                    cost += adjoint_copy(b, lb, sb, stored_b, bo)
                record = (bo, how.fo_a, how.fo_b)
                for swap, layout in zip((False, True), how.result_layouts(), strict=True):
                    lhs, rhs = (vb.flipped(), va.flipped()) if swap else (va, vb)
                    gemm = model.step_time(MatMul.of(2, lhs, rhs, itemsize))
                    total = cost + gemm * (1 + adj[a] + adj[b] if adj[node] else 1)
                    old = table.get(layout)
                    if old is None or total < old.cost:
                        table[layout] = _State(total, (*sa.swaps, *sb.swaps, (k, swap)), record)
        tables.append(dict(sorted(table.items(), key=lambda kv: kv[1].cost)[:KEEP]))

    out_layout = nonunit(problem.output)
    root = tree.root

    def finish(layout: Layout, state: _State) -> float:
        cost = state.cost
        if layout != out_layout:
            cost += copy_time(layout, out_layout)
        if adj[root] and matrix_view(0, out_layout, sizes, *state.record) is None:
            cost += copy_time(out_layout, layout)  # dY into the root's layout
        return cost

    _, best = min(tables[root].items(), key=lambda kv: finish(*kv))
    swaps = dict(best.swaps)
    assert len(swaps) == len(tree.steps)
    return tuple(swaps[k] for k in range(len(tree.steps)))
