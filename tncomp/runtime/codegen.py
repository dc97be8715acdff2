"""Turn a :class:`~tncomp.compiler.plan.Plan` into two straight-line Python functions over torch.

Like torch.fx, the plan is rendered as source (one line per step, freeing each value after its
last use) and compiled once, so a cached plan runs with no interpreter loop. Reshapes that are
statically no-ops are left out; large GEMM results are written into pooled buffers
(:mod:`tncomp.runtime.buffers`). A failure re-raises as :class:`ExecutionError` naming the
pass, the step and what it computes.
"""

from __future__ import annotations

import linecache
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tncomp.compiler.ops import Expand, MatMul, MatView, Op, Permute, Reshape, Sum
from tncomp.compiler.plan import Plan
from tncomp.errors import ExecutionError
from tncomp.runtime.buffers import MIN_POOLED_BYTES, BufferPool, alias, pooling_available

THIN_COLS = 8  # a CPU GEMM A^T B with this few output columns ...
THIN_MIN_INNER = 1024  # ... and this long an inner size is run transposed


def thin_transposed(op: MatMul, device: torch.device) -> bool:
    """A CPU GEMM ``A^T B`` with at most ``THIN_COLS`` output columns: CPU BLAS runs it up to
    14x slower than the transposed product ``(B^T A)^T`` (measured: x^T dz with x 4096x1024
    and dz 4096x8 took 33 ms, dz^T x 4 ms; at 16 columns 5.6 vs 3.5 ms). The weight gradient
    of a low-rank TT layer is exactly this GEMM. Codegen runs it transposed by this rule;
    autotune measures the orientation of other GEMMs (:attr:`MatMul.transposed`)."""
    m, k = op.lhs.rows_cols
    n = op.rhs.rows_cols[1]
    return (device.type == "cpu" and op.lhs.t and not op.rhs.t
            and n <= THIN_COLS < m and k >= THIN_MIN_INNER)


def runs_transposed(op: MatMul, device: torch.device) -> bool:
    """Whether codegen emits ``op`` as ``(rhs^T @ lhs^T)^T``: marked so, or by the thin rule."""
    return op.transposed or thin_transposed(op, device)


@dataclass(frozen=True)
class GeneratedCode:
    """The source and the compiled functions of one plan, and its buffer pools."""

    source: str
    forward: Callable
    backward: Callable
    pools: dict = field(default_factory=dict)


class _Emitter:
    def __init__(self, plan: Plan, operand_shapes, dtype, device, pool: bool):
        self.plan = plan
        self.shapes: dict[int, tuple[int, ...]] = dict(enumerate(operand_shapes))
        self.shapes[plan.dy_slot] = plan.output_shape
        self.dtype = dtype
        self.device = device
        self.pool = pool and pooling_available()
        self.pools: dict[int, BufferPool] = {}
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.exits = {plan.output_slot, *(s for s in plan.grad_slots if s is not None)}
        self.conjugate = False  # set while emitting the backward of a complex plan

    def view(self, v: MatView) -> str:
        text = f"v{v.slot}"
        if self.shapes.get(v.slot) != v.shape:
            text += f".reshape({v.shape!r})"
        if self.conjugate and v.slot < self.plan.dy_slot:  # d(AB): dY B^H, A^H dY
            text += ".conj()"
        return f"{text}.mT" if v.t else text


    def reshape(self, src: int, shape: tuple[int, ...]) -> str:
        if self.shapes.get(src) == shape:
            return f"v{src}"
        return f"v{src}.reshape({shape!r})"

    def line(self, op: Op) -> str:
        if isinstance(op, MatMul):
            batched = len(op.lhs.shape) == 3
            fn = "bmm" if batched else "mm"
            m = op.lhs.rows_cols[0]
            n = op.rhs.rows_cols[1]
            shape = ((op.lhs.shape[0],) if batched else ()) + (m, n)
            self.shapes[op.dst] = shape
            if runs_transposed(op, self.device):  # C = (B^T A^T)^T: same values, fast layout
                return (f"v{op.dst} = torch.{fn}({self.view(op.rhs)}.mT, {self.view(op.lhs)}.mT)"
                        ".mT.contiguous()")
            out = ""
            if self.pool and math.prod(shape) * self.itemsize >= MIN_POOLED_BYTES:
                self.pools[op.dst] = BufferPool(shape, self.dtype, self.device)
                out = f", out=_pool{op.dst}.take()"
            return f"v{op.dst} = torch.{fn}({self.view(op.lhs)}, {self.view(op.rhs)}{out})"
        if isinstance(op, Permute):
            self.shapes[op.dst] = tuple(op.shape[p] for p in op.perm)
            return (f"v{op.dst} = {self.reshape(op.src, op.shape)}.permute({op.perm!r})"
                    ".contiguous()")
        if isinstance(op, Reshape):
            self.shapes[op.dst] = op.shape
            if op.dst in self.exits and op.src in self.pools:
                return f"v{op.dst} = _alias(v{op.src}, {op.shape!r})"
            return f"v{op.dst} = {self.reshape(op.src, op.shape)}"
        if isinstance(op, Sum):
            self.shapes[op.dst] = tuple(s for k, s in enumerate(op.shape) if k not in op.dims)
            return f"v{op.dst} = {self.reshape(op.src, op.shape)}.sum({op.dims!r})"
        if isinstance(op, Expand):
            self.shapes[op.dst] = op.shape
            return (f"v{op.dst} = {self.reshape(op.src, op.view)}.expand({op.shape!r})"
                    ".contiguous()")
        raise TypeError(f"unknown op {op!r}")

    def body(self, ops, frees) -> list[str]:
        lines = []
        for k, (op, free) in enumerate(zip(ops, frees, strict=True)):
            lines.append(f"        step = {k}")
            lines.append(f"        {self.line(op)}")
            if free:
                lines.append(f"        del {', '.join(f'v{s}' for s in free)}")
        return lines or ["        pass"]


def _tuple(names: list[str]) -> str:
    return "(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")"


def generate(plan: Plan, operand_shapes, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu", name: str = "plan",
             pool: bool = True) -> GeneratedCode:
    """Render and compile ``plan`` into ``forward(*operands)`` and ``backward(...)``."""
    emit = _Emitter(plan, [tuple(s) for s in operand_shapes], dtype, torch.device(device), pool)
    n = plan.n_operands
    args = [f"v{k}" for k in range(n)]
    saved = [f"v{s}" for s in plan.saved]
    fwd = [f"def forward({', '.join(args)}):", "    step = -1", "    try:"]
    fwd += emit.body(plan.forward, plan.forward_frees)
    fwd += ["    except Exception as exc:", "        _fail(exc, 'forward', step)",
            f"    return v{plan.output_slot}, {_tuple(saved)}"]
    grads = ["None" if s is None else f"v{s}" for s in plan.grad_slots]
    bwd = [f"def backward(operands, saved, v{plan.dy_slot}):",
           f"    {_tuple(args)} = operands",
           f"    {_tuple(saved)} = saved" if saved else "    pass",
           "    step = -1", "    try:"]
    emit.conjugate = dtype.is_complex
    bwd += emit.body(plan.backward, plan.backward_frees)
    bwd += ["    except Exception as exc:", "        _fail(exc, 'backward', step)",
            f"    return {_tuple(grads)}"]
    source = "\n".join([*fwd, "", *bwd]) + "\n"

    def fail(exc: Exception, which: str, step: int) -> None:
        ops = plan.forward if which == "forward" else plan.backward
        what = ops[step].describe() if 0 <= step < len(ops) else "setup"
        raise ExecutionError(
            f"{type(exc).__name__} while executing {which} step {step} ({what}) of {name}: {exc}"
        ) from exc

    namespace = {"torch": torch, "_fail": fail, "_alias": alias}
    namespace.update({f"_pool{slot}": p for slot, p in emit.pools.items()})
    filename = f"<tncomp {name} {id(plan):x}>"
    exec(compile(source, filename, "exec"), namespace)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    return GeneratedCode(source, namespace["forward"], namespace["backward"], emit.pools)
