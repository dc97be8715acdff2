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
from tncomp.compiler.ops import Expand, MatMul, MatView, Op, Permute, Reshape, Sum
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

    def table(self) -> str:
        """The steps as a readable table: pass, step, what it computes, FLOPs, bytes."""
        rows = [("pass", "#", "step", "note", "MFLOP", "MB")]
        for name, ops in (("fwd", self.forward), ("bwd", self.backward)):
            for k, op in enumerate(ops):
                rows.append((name, str(k), op.describe(), op.note,
                             f"{op.flops / 1e6:.2f}", f"{op.nbytes / 1e6:.2f}"))
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


def _costs_time(op: Op) -> bool:
    return not isinstance(op, Reshape)


def slot_elements(plan: Plan) -> dict[int, int]:
    """Elements of every value the forward steps make, by slot."""
    out: dict[int, int] = {}
    for op in plan.forward:
        if isinstance(op, MatMul):
            rows = op.lhs.rows_cols[0]
            cols = op.rhs.rows_cols[1]
            out[op.dst] = (op.lhs.shape[0] if len(op.lhs.shape) == 3 else 1) * rows * cols
        elif isinstance(op, Sum):
            out[op.dst] = math.prod(s for k, s in enumerate(op.shape) if k not in op.dims)
        elif isinstance(op, Permute | Reshape):
            out[op.dst] = math.prod(op.shape)
        else:  # an Expand only appears in backward passes
            out[op.dst] = math.prod(op.shape)
    return out


@dataclass
class _Value:
    slot: int
    layout: tuple[str, ...]  # non-unit indices, memory order


@dataclass
class _Operand:
    view: MatView  # the (batched) matrix view of the storage
    permuted: Permute | None  # the copy made for it, if any
    free_order: tuple[str, ...]  # its free indices, in storage order


@dataclass
class _StepRecord:
    a: _Operand
    b: _Operand
    swapped: bool
    out_shape: tuple[int, ...]  # storage shape of the result (batched matrix)


def _split(layout, batch, free, contr):
    """(batch order, free order, contracted order, free_first) if the layout groups, else None."""
    nb = len(batch)
    if set(layout[:nb]) != batch:
        return None
    rest = layout[nb:]
    if set(rest[: len(free)]) == free:
        return layout[:nb], rest[: len(free)], rest[len(free):], True
    if set(rest[: len(contr)]) == contr:
        return layout[:nb], rest[len(contr):], rest[: len(contr)], False
    return None


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
        perm = tuple(value.layout.index(i) for i in target)
        op = Permute(self.slot(), value.slot, self.shape(value.layout), perm,
                     2 * self.vol(target) * self.itemsize, note)
        ops.append(op)
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

    def operand(self, value: _Value, batch, free, contr, bo, ko, is_left: bool, note) -> _Operand:
        split = _split(value.layout, set(batch), set(free), set(contr))
        copy = None
        if split is not None and split[0] == bo and split[2] == ko:
            _, fo, _, free_first = split
            stored = value
        else:
            fo = tuple(i for i in value.layout if i in free)
            free_first = is_left
            target = (*bo, *fo, *ko) if is_left else (*bo, *ko, *fo)
            stored = self.permute(self.fwd, value, target, note)
            copy = self.fwd[-1]
        nb, nf, nk = self.vol(bo), self.vol(fo), self.vol(ko)
        rows_cols = (nf, nk) if free_first else (nk, nf)
        shape = ((nb,) if bo else ()) + rows_cols
        # Left operand's logical matrix is (free, contr); the right one's is (contr, free).
        t = (not free_first) if is_left else free_first
        return _Operand(MatView(stored.slot, shape, t), copy, tuple(fo))

    def contract(self, a: _Value, b: _Value, kept: tuple[str, ...], swap: bool, k: int):
        kept_set = set(self.nonunit(kept))
        ia, ib = set(a.layout), set(b.layout)
        batch = ia & ib & kept_set
        contr = (ia & ib) - kept_set
        fa, fb = ia - ib, ib - ia
        if not (fa <= kept_set and fb <= kept_set):
            raise PlanError(f"step {k}: an index of one operand only is not kept (internal).")
        sa = _split(a.layout, batch, fa, contr)
        sb = _split(b.layout, batch, fb, contr)
        options = []
        if sa:
            options.append((sa[0], sa[2]))
        if sb:
            options.append((sb[0], sb[2]))
        options.append((tuple(i for i in a.layout if i in batch),
                        tuple(i for i in a.layout if i in contr)))

        def copies(opt):
            bo, ko = opt
            cost = 0
            for s, v in ((sa, a), (sb, b)):
                if not (s and s[0] == bo and s[2] == ko):
                    cost += self.vol(v.layout)
            return cost

        bo, ko = min(options, key=copies)
        oa = self.operand(a, batch, fa, contr, bo, ko, True, f"step {k}: lay out left operand")
        ob = self.operand(b, batch, fb, contr, bo, ko, False, f"step {k}: lay out right operand")
        fo_a, fo_b = oa.free_order, ob.free_order
        m, kk = oa.view.rows_cols
        n = ob.view.rows_cols[1]
        nb = self.vol(bo)
        if swap:
            lhs, rhs, layout = ob.view.flipped(), oa.view.flipped(), (*bo, *fo_b, *fo_a)
            out_shape = ((nb,) if bo else ()) + (n, m)
        else:
            lhs, rhs, layout = oa.view, ob.view, (*bo, *fo_a, *fo_b)
            out_shape = ((nb,) if bo else ()) + (m, n)
        flops = 2 * nb * m * kk * n
        nbytes = (nb * (m * kk + kk * n + m * n)) * self.itemsize
        op = MatMul(self.slot(), lhs, rhs, flops, nbytes, f"step {k}: node {self.n + k}")
        self.fwd.append(op)
        self.layouts[op.dst] = layout
        return _Value(op.dst, layout), _StepRecord(oa, ob, swap, out_shape)

    def adjoint_of(self, rec_op: _Operand, other: _Operand, d_out: MatView, left: bool, note):
        """Emit the GEMM making the adjoint of one operand in its storage orientation."""
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
        m, kk = lhs.rows_cols
        n = rhs.rows_cols[1]
        nb = view.shape[0] if len(view.shape) == 3 else 1
        op = MatMul(self.slot(), lhs, rhs, 2 * nb * m * kk * n,
                    nb * (m * kk + kk * n + m * n) * self.itemsize, note)
        self.bwd.append(op)
        slot = op.dst
        if rec_op.permuted is not None:  # undo the forward copy
            p = rec_op.permuted
            inverse = tuple(p.perm.index(j) for j in range(len(p.perm)))
            permuted_shape = tuple(p.shape[j] for j in p.perm)
            back = Permute(self.slot(), slot, permuted_shape, inverse, p.nbytes,
                           note + " (unpermute)")
            self.bwd.append(back)
            slot = back.dst
        return slot

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

        # Backward: the reversed tree.
        adj = adjoint_nodes(tree, self.needs_grad)
        dy_slot = self.slot()
        grad_slots: list[int | None] = [None] * n
        adjoint: dict[int, int] = {}
        if any(self.needs_grad):
            d_root = _Value(dy_slot, out_layout)
            if values[tree.root].layout != out_layout:  # (an operand root was copied as is)
                d_root = self.permute(self.bwd, d_root, values[tree.root].layout, "dY layout")
            adjoint[tree.root] = d_root.slot
        for k in reversed(range(len(tree.steps))):
            a, b = tree.steps[k]
            node = n + k
            if node not in adjoint:
                continue
            rec = records[k]
            d_shape = rec.out_shape
            d_out = MatView(adjoint[node], d_shape, rec.swapped)
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
            kept = p.leaf_kept[k]
            if any(i not in kept and self.sizes[i] != 1 for i in term):
                view = tuple(self.sizes[i] if i in kept else 1 for i in term)
                op = Expand(self.slot(), adjoint[k], view, full, self.vol(term) * self.itemsize,
                            f"grad of operand {k}")
            else:
                op = Reshape(self.slot(), adjoint[k], full, f"grad of operand {k}")
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

    ``swaps[k]`` picks the orientation of step k's result; by default each is chosen (two sweeps
    of coordinate descent) to minimise the modelled forward+backward time. Each trial of the
    descent lowers the whole tree again, so on a tree of more than :data:`BUDGETED_STEPS` steps
    a spent ``budget`` stops it early with the best orientations found so far (smaller trees,
    every TT layer among them, always finish: their plans do not depend on the machine's load).
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

    def score(sw) -> float:
        return _Lowering(problem, tree, needs_grad, itemsize).run(sw).modelled_time(model)

    best = [False] * n_steps
    best_score = score(best)
    for _ in range(2):
        improved = False
        for k in range(n_steps):
            if budget is not None and n_steps > BUDGETED_STEPS and budget.spent:
                log.debug("lower: orientation search stopped by the budget at step %d", k)
                return _Lowering(problem, tree, needs_grad, itemsize).run(best)
            trial = list(best)
            trial[k] = not trial[k]
            s = score(trial)
            if s < best_score - 1e-12:
                best, best_score, improved = trial, s, True
        if not improved:
            break
    return _Lowering(problem, tree, needs_grad, itemsize).run(best)
