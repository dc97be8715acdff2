"""Lowering: a contraction tree over bound sizes -> a flat, printable plan of primitive steps.

Every value lives contiguous in a known index order (its *layout*). A pairwise contraction is
run as one GEMM (or batched GEMM) over reshaped views, with transposes passed to BLAS as flags
rather than copied; a permute copy is emitted only when an operand's indices cannot be grouped
into (batch, free, contracted) blocks. The backward plan is the reversed tree: each adjoint is
made directly in the storage orientation of the value it belongs to, so it needs no copy either.
Indices of size 1 are dropped from layouts: they never cost a copy.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tncomp.compiler.budget import Budget
from tncomp.compiler.cost import adjoint_nodes
from tncomp.compiler.device_model import DeviceModel
from tncomp.compiler.layouts import matrix_view, pair, permute_op
from tncomp.compiler.ops import Expand, MatMul, MatView, Op, Permute, Reshape, Sum
from tncomp.compiler.orient import orientations
from tncomp.compiler.problem import Problem, Tree
from tncomp.errors import PlanError

log = logging.getLogger("tncomp.compiler.plan")

BUDGETED_STEPS = 24  # the orientation search of a larger tree stops when its budget is spent


@dataclass(frozen=True)
class Plan:
    """Forward and backward steps over numbered slots, ready for an executor.

    Slots ``0..n_operands-1`` hold the operands and slot ``dy_slot`` the output gradient.
    ``saved`` lists the forward slots the backward reads; ``grad_slots[k]`` holds the gradient
    of operand k after the backward steps (``None`` when not requested). ``recomputed`` lists
    the forward slots a memory mode dropped from ``saved``: the backward steps rebuild each
    from the operands (and kept slots) by replaying the forward steps that made it, just before
    its first use (:mod:`tncomp.compiler.memory`). ``layouts[s]`` is the index order of forward
    slot ``s`` (its size as a formula in the symbolic sizes).
    """

    n_operands: int
    tree: Tree
    needs_grad: tuple[bool, ...]
    itemsize: int
    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    output_slot: int
    output_shape: tuple[int, ...]
    dy_slot: int
    grad_slots: tuple[int | None, ...]
    saved: tuple[int, ...]
    forward_frees: tuple[tuple[int, ...], ...]
    backward_frees: tuple[tuple[int, ...], ...]
    n_slots: int
    swaps: tuple[bool, ...] = field(default=())
    layouts: tuple[tuple[str, ...], ...] = field(default=())
    recomputed: tuple[int, ...] = field(default=())

    @property
    def forward_flops(self) -> int:
        """FLOPs of the forward steps."""
        return sum(op.flops for op in self.forward)

    @property
    def backward_flops(self) -> int:
        """FLOPs of the backward steps (0 when no gradient is requested)."""
        return sum(op.flops for op in self.backward)

    @property
    def forward_bytes(self) -> int:
        """Bytes the forward steps read and write."""
        return sum(op.nbytes for op in self.forward)

    @property
    def backward_bytes(self) -> int:
        """Bytes the backward steps read and write."""
        return sum(op.nbytes for op in self.backward)

    @property
    def copy_bytes(self) -> int:
        """Bytes moved by permute copies (zero for a layout-perfect plan)."""
        return sum(op.nbytes for op in (*self.forward, *self.backward) if isinstance(op, Permute))

    @property
    def saved_bytes(self) -> int:
        """Bytes of the forward intermediates kept for the backward (the operands, which the
        caller holds and autograd saves anyway, not counted)."""
        elements = slot_elements(self)
        return sum(elements[s] for s in self.saved) * self.itemsize

    @property
    def peak_bytes(self) -> int:
        """The most bytes of values the plan holds at once, forward then backward: its
        intermediates, its output and the gradients it makes (the operands and dY, which the
        caller holds, not counted; a view shares its source's storage). What a memory limit
        is checked against before anything is allocated."""
        return peak_elements(self) * self.itemsize

    @property
    def recompute_ops(self) -> tuple[Op, ...]:
        """The forward steps the backward replays to rebuild the ``recomputed`` slots."""
        return tuple(op for op in self.backward if op.dst < self.dy_slot)

    @property
    def recompute_flops(self) -> int:
        """FLOPs of the replayed forward steps (part of :attr:`backward_flops`)."""
        return sum(op.flops for op in self.recompute_ops)

    def recompute_time(self, model: DeviceModel) -> float:
        """Seconds ``model`` predicts for the replayed forward steps (part of
        :meth:`modelled_time`)."""
        return sum(model.op_time(op.flops, op.nbytes) for op in self.recompute_ops
                   if _costs_time(op))

    def modelled_time(self, model: DeviceModel, backward: bool = True) -> float:
        """Seconds ``model`` predicts for the forward steps (and the backward ones, by default):
        :meth:`DeviceModel.step_time` summed over the steps, reshapes (free views) left out."""
        ops = (*self.forward, *self.backward) if backward else self.forward
        return sum(model.step_time(op) for op in ops if _costs_time(op))

    def floor_time(self, model: DeviceModel, backward: bool = True) -> float:
        """FLOPs at the GEMM rate (of each GEMM's shape, when ``model`` has a table) or bytes
        at bandwidth, step by step, with no overhead."""
        ops = (*self.forward, *self.backward) if backward else self.forward
        return sum(model.step_floor(op) for op in ops)

    def table(self, model: DeviceModel | None = None,
              measured: tuple[Sequence[float], Sequence[float]] | None = None) -> str:
        """The steps as a readable table: pass, step, what it computes, FLOPs, bytes; with a
        ``model``, each step's roofline floor (:meth:`DeviceModel.step_floor`); with
        ``measured`` (seconds of each forward and backward step), the time each took and its
        ratio to the floor, so the gap shows where it is."""
        head = ["pass", "#", "step", "note", "MFLOP", "MB"]
        if model is not None:
            head.append("floor ms")
        if measured is not None:
            head += ["ms", "x floor"] if model is not None else ["ms"]
        rows = [tuple(head)]
        for name, ops, times in (("fwd", self.forward, measured[0] if measured else None),
                                 ("bwd", self.backward, measured[1] if measured else None)):
            for k, op in enumerate(ops):
                row = [name, str(k), op.describe(), op.note, f"{op.flops / 1e6:.2f}",
                       f"{op.nbytes / 1e6:.2f}"]
                floor = model.step_floor(op) if model is not None else None
                if floor is not None:
                    row.append(f"{floor * 1e3:.3f}")
                if times is not None:
                    row.append(f"{times[k] * 1e3:.3f}")
                    if floor is not None:
                        row.append(f"{times[k] / floor:.1f}" if floor > 0 else "-")
                rows.append(tuple(row))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(v.ljust(w) if c < 4 else v.rjust(w) for c, (v, w) in
                           enumerate(zip(r, widths, strict=True))) for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        total = (f"total: forward {self.forward_flops / 1e6:.2f} MFLOP, backward "
                 f"{self.backward_flops / 1e6:.2f} MFLOP, permute copies "
                 f"{self.copy_bytes / 1e6:.2f} MB")
        return "\n".join([*lines, total])

    def __str__(self) -> str:
        return self.table()


@dataclass(frozen=True)
class Measured:
    """Median seconds of each forward and backward step of one plan, and of the whole
    forward + backward run without per-step clock reads (``total``), as
    :func:`tncomp.runtime.profile.measure_plan` measures them."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    total: float
    repeats: int
    threads: int

    @property
    def steps_total(self) -> float:
        """The per-step medians summed (close to :attr:`total`, plus the clock reads)."""
        return sum(self.forward) + sum(self.backward)


def _costs_time(op: Op) -> bool:
    return not isinstance(op, Reshape)


def result_elements(op: Op) -> int:
    """Elements of the value ``op`` makes (a reshape: its source's, seen anew)."""
    if isinstance(op, MatMul):
        return op.lhs.batch * op.lhs.rows_cols[0] * op.rhs.rows_cols[1]
    if isinstance(op, Sum):
        return math.prod(s for k, s in enumerate(op.shape) if k not in op.dims)
    return math.prod(op.shape)


def slot_elements(plan: Plan) -> dict[int, int]:
    """Elements of every value the forward steps make, by slot."""
    return {op.dst: result_elements(op) for op in plan.forward}


def peak_elements(plan: Plan) -> int:
    """The most elements live at once while ``plan`` runs (see :attr:`Plan.peak_bytes`)."""
    owner: dict[int, int | None] = {}  # slot -> the slot whose storage it uses
    refs: dict[int, int] = {}
    size: dict[int, int] = {}
    live = peak = 0
    for ops, frees in ((plan.forward, plan.forward_frees),
                       (plan.backward, plan.backward_frees)):
        for op, free in zip(ops, frees, strict=True):
            if isinstance(op, Reshape):  # a view: the source's storage, one more user
                base = owner.get(op.src)
                owner[op.dst] = base
                if base is not None:
                    refs[base] += 1
            else:
                owner[op.dst], refs[op.dst] = op.dst, 1
                size[op.dst] = result_elements(op)
                live += size[op.dst]
                peak = max(peak, live)
            for slot in free:
                base = owner.pop(slot, None)
                if base is not None:
                    refs[base] -= 1
                    if not refs[base]:
                        live -= size[base]
    return peak


@dataclass
class _Value:
    slot: int
    layout: tuple[str, ...]  # non-unit indices, memory order


@dataclass
class _Operand:
    view: MatView  # the (batched) matrix view of the storage (or of its copy)
    free_order: tuple[str, ...]  # its free indices, in storage order
    adjoint_layout: tuple[str, ...]  # the layout its adjoint GEMM writes


@dataclass
class _StepRecord:
    a: _Operand
    b: _Operand
    swapped: bool
    batch: tuple[str, ...]  # the batch order of the step's GEMM
    layout: tuple[str, ...]  # the result's layout: (batch, free of a, free of b), or swapped


class _Lowering:
    def __init__(self, problem: Problem, tree: Tree, needs_grad, itemsize: int):
        self.p = problem
        self.tree = tree
        self.needs_grad = tuple(bool(g) for g in needs_grad)
        self.itemsize = itemsize
        self.sizes = problem.size_dict
        self.n = problem.n_leaves
        self.next_slot = self.n
        self.fwd: list[Op] = []
        self.bwd: list[Op] = []
        self.layouts: dict[int, tuple[str, ...]] = {
            k: self.nonunit(problem.inputs[k]) for k in range(self.n)}

    def slot(self) -> int:
        self.next_slot += 1
        return self.next_slot - 1

    def vol(self, indices) -> int:
        return math.prod(self.sizes[i] for i in indices)

    def shape(self, indices) -> tuple[int, ...]:
        return tuple(self.sizes[i] for i in indices)

    def nonunit(self, indices) -> tuple[str, ...]:
        return tuple(i for i in indices if self.sizes[i] != 1)

    def permute(self, ops: list, value: _Value, target: tuple[str, ...], note: str) -> _Value:
        op = permute_op(self.slot(), value.slot, value.layout, target, self.sizes,
                        self.itemsize, note)
        ops.append(op)
        if ops is self.fwd:
            self.layouts[op.dst] = target
        return _Value(op.dst, target)

    def leaf(self, k: int) -> _Value:
        term = self.p.inputs[k]
        kept = self.p.leaf_kept[k]
        summed = [pos for pos, i in enumerate(term) if i not in kept and self.sizes[i] != 1]
        if summed:
            full = self.shape(term)
            op = Sum(self.slot(), k, full, tuple(summed), math.prod(full),
                     (math.prod(full) + self.vol(kept)) * self.itemsize, f"reduce operand {k}")
            self.fwd.append(op)
            self.layouts[op.dst] = self.nonunit(kept)
            return _Value(op.dst, self.nonunit(kept))
        return _Value(k, self.nonunit(kept))

    def operand(self, value: _Value, bo, fo, ko, copy: bool, is_left: bool, note) -> _Operand:
        """``value`` as the GEMM's left ``(bo; fo x ko)`` or right ``(bo; ko x fo)`` matrix:
        a view of its storage, or (``copy``) of a permuted copy."""
        rows, cols = (fo, ko) if is_left else (ko, fo)  # the logical matrix
        stored = value
        if copy:
            stored = self.permute(self.fwd, value, (*bo, *rows, *cols), note)
        view = matrix_view(stored.slot, stored.layout, self.sizes, bo, rows, cols)
        if view is None:
            raise PlanError(f"{note}: layout {stored.layout} has no matrix view (internal).")
        # the adjoint is written (batch, rows, cols) in the storage's order of rows and cols
        matrix = tuple(i for i in stored.layout if i not in bo)
        return _Operand(view, tuple(fo), (*bo, *matrix))

    def contract(self, a: _Value, b: _Value, kept: tuple[str, ...], swap: bool, k: int):
        kept_set = set(self.nonunit(kept))
        ia, ib = set(a.layout), set(b.layout)
        if not (ia - ib <= kept_set and ib - ia <= kept_set):
            raise PlanError(f"step {k}: an index of one operand only is not kept (internal).")
        how = pair(a.layout, b.layout, kept_set, self.sizes)
        bo, ko = how.bo, how.ko
        oa = self.operand(a, bo, how.fo_a, ko, how.copy_a, True,
                          f"step {k}: lay out left operand")
        ob = self.operand(b, bo, how.fo_b, ko, how.copy_b, False,
                          f"step {k}: lay out right operand")
        straight, swapped = how.result_layouts()
        if swap:
            lhs, rhs, layout = ob.view.flipped(), oa.view.flipped(), swapped
        else:
            lhs, rhs, layout = oa.view, ob.view, straight
        op = MatMul.of(self.slot(), lhs, rhs, self.itemsize, f"step {k}: node {self.n + k}")
        self.fwd.append(op)
        self.layouts[op.dst] = layout
        return _Value(op.dst, layout), _StepRecord(oa, ob, swap, tuple(bo), layout)

    def d_out(self, d: _Value, rec: _StepRecord, note: str) -> MatView:
        """The adjoint of a step's result as the matrix ``(batch; free of a x free of b)``: a
        view of ``d`` where its layout allows one, else of a copy in the result's layout."""
        fo_a, fo_b = rec.a.free_order, rec.b.free_order
        view = matrix_view(d.slot, d.layout, self.sizes, rec.batch, fo_a, fo_b)
        if view is None:
            d = self.permute(self.bwd, d, rec.layout, note)
            view = matrix_view(d.slot, d.layout, self.sizes, rec.batch, fo_a, fo_b)
        return view

    def adjoint_of(self, rec_op: _Operand, other: _Operand, d_out: MatView, left: bool,
                   note) -> _Value:
        """Emit the GEMM making the adjoint of one operand in its storage orientation (its
        batch first: :attr:`_Operand.adjoint_layout`)."""
        view = rec_op.view
        stored_t = view.t
        if left:  # dA_log = dOut_log @ B_log^T
            if not stored_t:
                lhs, rhs = d_out, other.view.flipped()
            else:
                lhs, rhs = other.view, d_out.flipped()
        else:  # dB_log = A_log^T @ dOut_log
            if not stored_t:
                lhs, rhs = other.view.flipped(), d_out
            else:
                lhs, rhs = d_out.flipped(), other.view
        op = MatMul.of(self.slot(), lhs, rhs, self.itemsize, note)
        self.bwd.append(op)
        return _Value(op.dst, rec_op.adjoint_layout)

    def run(self, swaps: Sequence[bool]) -> Plan:
        p, tree = self.p, self.tree
        n = self.n
        values: list[_Value] = [self.leaf(k) for k in range(n)]
        records: list[_StepRecord] = []
        covers = tree.leaves_under()
        for k, (a, b) in enumerate(tree.steps):
            kept = p.kept_after(covers[n + k])
            value, rec = self.contract(values[a], values[b], kept, swaps[k], k)
            values.append(value)
            records.append(rec)
        root = values[tree.root]
        out_layout = self.nonunit(p.output)
        output_shape = self.shape(p.output)
        if root.layout != out_layout or root.slot < n:  # never hand back an operand's storage
            root = self.permute(self.fwd, root, out_layout, "output layout")
        final = Reshape(self.slot(), root.slot, output_shape, "output")
        self.fwd.append(final)
        self.layouts[final.dst] = out_layout

        # Backward: the reversed tree. Each adjoint keeps the layout its GEMM wrote; a step
        # reads its result's adjoint in place when that layout allows (dY, say, read as a
        # strided batch), else through a copy in the result's layout.
        adj = adjoint_nodes(tree, self.needs_grad)
        dy_slot = self.slot()
        grad_slots: list[int | None] = [None] * n
        adjoint: dict[int, _Value] = {}
        if any(self.needs_grad):
            adjoint[tree.root] = _Value(dy_slot, out_layout)
        for k in reversed(range(len(tree.steps))):
            a, b = tree.steps[k]
            node = n + k
            if node not in adjoint:
                continue
            rec = records[k]
            d_out = self.d_out(adjoint[node], rec, f"grad of node {node} (layout)")
            if adj[a]:
                adjoint[a] = self.adjoint_of(rec.a, rec.b, d_out, True, f"grad of node {a}")
            if adj[b]:
                adjoint[b] = self.adjoint_of(rec.b, rec.a, d_out, False, f"grad of node {b}")
        for k in range(n):
            if not self.needs_grad[k]:
                continue
            term = p.inputs[k]
            full = self.shape(term)
            if k not in adjoint:  # a network of one operand: the output adjoint is its own
                raise PlanError("internal: missing adjoint for operand")
            grad = adjoint[k]
            if grad.layout != values[k].layout:  # (its forward read went through a copy)
                grad = self.permute(self.bwd, grad, values[k].layout,
                                    f"grad of operand {k} (layout)")
            kept = p.leaf_kept[k]
            if any(i not in kept and self.sizes[i] != 1 for i in term):
                view = tuple(self.sizes[i] if i in kept else 1 for i in term)
                op = Expand(self.slot(), grad.slot, view, full, self.vol(term) * self.itemsize,
                            f"grad of operand {k}")
            else:
                op = Reshape(self.slot(), grad.slot, full, f"grad of operand {k}")
            self.bwd.append(op)
            grad_slots[k] = op.dst
        return self.finish(final.dst, output_shape, dy_slot, tuple(grad_slots), tuple(swaps))

    def finish(self, output_slot, output_shape, dy_slot, grad_slots, swaps) -> Plan:
        n = self.n
        first_bwd_slot = dy_slot
        saved = sorted({s for op in self.bwd for s in op.reads if n <= s < first_bwd_slot})
        keep_fwd = set(saved) | {output_slot}
        fwd_frees = frees_after(self.fwd, keep_fwd | set(range(n)))
        keep_bwd = {s for s in grad_slots if s is not None} | set(range(n))
        bwd_frees = frees_after(self.bwd, keep_bwd)
        return Plan(
            n_operands=n, tree=self.tree, needs_grad=self.needs_grad, itemsize=self.itemsize,
            forward=tuple(self.fwd), backward=tuple(self.bwd), output_slot=output_slot,
            output_shape=output_shape, dy_slot=dy_slot, grad_slots=grad_slots,
            saved=tuple(saved), forward_frees=fwd_frees, backward_frees=bwd_frees,
            n_slots=self.next_slot, swaps=swaps,
            layouts=tuple(self.layouts.get(s, ()) for s in range(first_bwd_slot)),
        )


def frees_after(ops: Sequence[Op], keep: set[int]) -> tuple[tuple[int, ...], ...]:
    """For every op, the slots whose last read it is (and that are not kept)."""
    last: dict[int, int] = {}
    for k, op in enumerate(ops):
        for s in op.reads:
            last[s] = k
    frees: list[list[int]] = [[] for _ in ops]
    for s, k in last.items():
        if s not in keep:
            frees[k].append(s)
    return tuple(tuple(sorted(f)) for f in frees)


def lower(
    problem: Problem,
    tree: Tree,
    needs_grad: Sequence[bool],
    itemsize: int = 4,
    swaps: Sequence[bool] | None = None,
    model: DeviceModel | None = None,
    budget: Budget | None = None,
) -> Plan:
    """Lower ``tree`` over the bound ``problem`` into a :class:`Plan`.

    ``swaps[k]`` picks the orientation of step k's result; by default the dynamic program of
    :mod:`~tncomp.compiler.orient` chooses them, then one sweep of coordinate descent over the
    whole plan's modelled forward+backward time polishes its choice. Each trial of the sweep
    lowers the whole tree again, so on a tree of more than :data:`BUDGETED_STEPS` steps a spent
    ``budget`` stops it early (smaller trees, every TT layer among them, always finish: their
    plans do not depend on the machine's load).
    """
    for i, s in problem.size_dict.items():
        if not isinstance(s, int):
            raise PlanError(f"index {i!r} has unbound size {s}; bind every size before lowering.")
    if len(needs_grad) != problem.n_leaves:
        raise PlanError(
            f"needs_grad has {len(needs_grad)} entries for {problem.n_leaves} operands.")
    n_steps = len(tree.steps)
    if swaps is not None:
        return _Lowering(problem, tree, needs_grad, itemsize).run(list(swaps))
    model = model or DeviceModel()

    def run(sw) -> Plan:
        return _Lowering(problem, tree, needs_grad, itemsize).run(sw)

    best = list(orientations(problem, tree, needs_grad, itemsize, model))
    plan = run(best)
    best_score = plan.modelled_time(model)
    for k in range(n_steps):
        if budget is not None and n_steps > BUDGETED_STEPS and budget.spent:
            log.debug("lower: orientation polish stopped by the budget at step %d", k)
            break
        trial = list(best)
        trial[k] = not trial[k]
        candidate = run(trial)
        score = candidate.modelled_time(model)
        if score < best_score - 1e-12:
            best, best_score, plan = trial, score, candidate
    return plan
