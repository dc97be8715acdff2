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

from tncomp.compiler.ops import Expand, MatMul, MatView, Op, Permute, Reshape, Sum, blocked
from tncomp.compiler.plan import Plan
from tncomp.errors import ExecutionError
from tncomp.runtime.buffers import MIN_POOLED_BYTES, BufferPool, alias, pooling_available
from tncomp.runtime.transpose import permute_into

THIN_COLS = 32  # a CPU GEMM with this few output columns (and more rows) ...
THIN_MIN_INNER = 128  # ... and at least this long an inner size is run transposed ...
THIN_ALIGNED_MIN_ROWS = 1024  # ... unless A B / A B^T, columns a multiple of 8, rows this many
NARROW_SIDE = 16  # a batched GEMM with an output side this narrow puts it as rows ...
NARROW_FLIP = 8  # ... copying back only columns this narrow, or a result narrow both ways
REDUCTION_MAX_OUT = 0.05  # a GEMM of two transposed operands with an output this small
FUSE_MIN_BYTES = 4 << 20  # a shared GEMM operand this large (out of cache) ...
FUSE_MAX_THIN = 64  # ... read by two GEMMs with outputs this thin ...
FUSE_BLOCK = 256  # ... is read once, in blocks of this many rows (fused_rows)


def thin_transposed(op: MatMul, device: torch.device) -> bool:
    """A CPU GEMM ``C = A B`` with a thin output (at most ``THIN_COLS`` columns, more rows, an
    inner size of at least ``THIN_MIN_INNER``) runs as ``(B^T A^T)^T``: CPU BLAS (MKL, AVX2)
    handles the thin side far better as rows than as columns. The weight gradient ``A^T B``
    always flips; ``A B`` and ``A B^T`` with many rows and a multiple of 8 columns stay direct
    (that suits the BLAS kernel); the measurements are in docs/results.md, "Measured rules of the
    CPU executor".
    ``compile(..., autotune=True)`` measures other GEMMs (:attr:`MatMul.transposed`)."""
    m, k = op.lhs.rows_cols
    n = op.rhs.rows_cols[1]
    if device.type != "cpu" or not (n <= THIN_COLS < m and k >= THIN_MIN_INNER):
        return False
    weight_grad = op.lhs.t and not op.rhs.t  # A^T B
    return weight_grad or n % 8 != 0 or m < THIN_ALIGNED_MIN_ROWS


def reduction_transposed(op: MatMul, device: torch.device) -> bool:
    """A CPU GEMM ``C = A^T B^T`` (both operands transposed) whose output is small against its
    inputs (at most ``REDUCTION_MAX_OUT`` of them: a weight gradient summing over the batch)
    runs as ``(B A)^T``, both operands read as stored. MKL reads a long inner size through two
    transposed operands at a small fraction of its rate (docs/formats.md has the figures)."""
    if device.type != "cpu" or not (op.lhs.t and op.rhs.t):
        return False
    m, k = op.lhs.rows_cols
    n = op.rhs.rows_cols[1]
    return m * n <= REDUCTION_MAX_OUT * k * (m + n)


def narrow_batch_side(op: MatMul, device: torch.device) -> bool | None:
    """For a CPU batched GEMM (``bmm``) with an output side of at most ``NARROW_SIDE``: whether
    to run it transposed, so that the narrow side is the output's rows (True when the direct
    product has at most ``NARROW_FLIP`` columns and more rows, or is narrow both ways; False
    otherwise); None for other GEMMs (the thin and reduction rules decide those).

    Why: a block format (BTT) runs many small GEMMs per block, e.g. 64 blocks of (2048 x 16) @
    (16 x 8), and MKL's batched kernel runs them several times faster with the 8-wide side as
    rows than as columns, in both the forward shapes and the weight gradients' long reductions.
    A 16-wide side runs about as fast either way, so flipping a (2048 x 16) result only adds
    the copy back, a thin transpose that costs more than the GEMM (figures in
    docs/results.md, "Measured rules of the CPU executor")."""
    if device.type != "cpu" or op.lhs.batch <= 1:
        return None
    m = op.lhs.rows_cols[0]
    n = op.rhs.rows_cols[1]
    if min(m, n) > NARROW_SIDE or m == n:
        return None
    return n < m and (n <= NARROW_FLIP or m <= NARROW_SIDE)


def runs_transposed(op: MatMul, device: torch.device) -> bool:
    """Whether codegen emits ``op`` as ``(rhs^T @ lhs^T)^T``: marked so, or by the narrow
    batched rule, else the thin or the reduction rule."""
    if op.transposed:
        return True
    narrow = narrow_batch_side(op, device)
    if narrow is not None:
        return narrow
    return thin_transposed(op, device) or reduction_transposed(op, device)


def fused_rows(v: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
               block: int = FUSE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(v @ x, y @ v)`` in one pass over ``v``'s rows (``v`` (M, N), ``x`` (N, n1), ``y``
    (m2, M), ``n1`` and ``m2`` thin): each block of rows is read while it is in cache, once
    for ``(x^T v_rows^T)^T`` and once for ``y[:, rows] @ v_rows``, summed over the blocks.

    The backward of a TT layer's widest step reads its output gradient dY this way twice
    (dT = dY R^T, dR = T^T dY); what it saves is in docs/results.md, "Measured rules of the CPU
    executor"."""
    m = v.shape[0]
    out1_t = torch.empty((x.shape[1], m), dtype=v.dtype, device=v.device)  # (n1, M)
    out2 = None
    for start in range(0, m, block):
        rows = v[start:start + block]  # (block, N)
        torch.mm(x.mT, rows.mT, out=out1_t[:, start:start + block])
        if out2 is None:
            out2 = torch.mm(y[:, start:start + block], rows)  # (m2, N)
        else:
            out2.addmm_(y[:, start:start + block], rows)
    return out1_t.mT.contiguous(), out2


@dataclass(frozen=True)
class GeneratedCode:
    """The source and the compiled functions of one plan, its buffer pools, and how many GEMM
    pairs its backward runs fused (:func:`fused_rows`: in-place, so the plain code has none)."""

    source: str
    forward: Callable
    backward: Callable
    pools: dict = field(default_factory=dict)
    fused: int = 0


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
        self.fused = 0
        self.constants: dict[str, object] = {}  # names the generated code reads
        self.timed = False  # call _mark(pass, step) after every step (tncomp.runtime.profile)

    def view(self, v: MatView) -> str:
        text = f"v{v.slot}"
        if self.shapes.get(v.slot) != v.shape:
            text += f".reshape({v.shape!r})"
        if v.batch_axis:  # a strided batch: (rows, batch, cols) -> (batch, rows, cols)
            text += ".permute(1, 0, 2)"
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
            shape = ((op.lhs.batch,) if batched else ()) + (m, n)
            self.shapes[op.dst] = shape
            pooled = self.pool and math.prod(shape) * self.itemsize >= MIN_POOLED_BYTES
            if runs_transposed(op, self.device):  # C = (B^T A^T)^T: same values, fast layout
                product = f"torch.{fn}({self.view(op.rhs.flipped())}, {self.view(op.lhs.flipped())}"
                if not pooled:
                    return f"v{op.dst} = {product}).mT.contiguous()"
                # C^T and C in pooled buffers, as the direct product gets: fresh ones cost page
                # faults (see tncomp.runtime.buffers)
                t_slot = self.plan.n_slots + op.dst
                self.pools[op.dst] = BufferPool(shape, self.dtype, self.device)
                self.pools[t_slot] = BufferPool((*shape[:-2], n, m), self.dtype, self.device)
                return (f"v{op.dst} = _pool{op.dst}.take().copy_({product}, "
                        f"out=_pool{t_slot}.take()).mT)")
            out = ""
            if pooled:
                self.pools[op.dst] = BufferPool(shape, self.dtype, self.device)
                out = f", out=_pool{op.dst}.take()"
            return f"v{op.dst} = torch.{fn}({self.view(op.lhs)}, {self.view(op.rhs)}{out})"
        if isinstance(op, Permute):
            shape = tuple(op.shape[p] for p in op.perm)
            self.shapes[op.dst] = shape
            pooled = math.prod(shape) * self.itemsize >= MIN_POOLED_BYTES
            swap = op.swap
            # autograd, vmap, CUDA; or a small copy (unpooled) that is not run as 2-D
            # transposes: one inline permute copy (the helper would add a call and an empty)
            if not (self.pool and self.device.type == "cpu") or not (pooled or blocked(swap)):
                return (f"v{op.dst} = {self.reshape(op.src, op.shape)}.permute({op.perm!r})"
                        ".contiguous()")
            out = f"v{op.src}.new_empty({shape!r})"
            if pooled:
                self.pools[op.dst] = BufferPool(shape, self.dtype, self.device)
                out = f"_pool{op.dst}.take()"
            self.constants[f"_swap{op.dst}"] = swap
            return (f"v{op.dst} = _permute_into({out}, v{op.src}, {op.shape!r}, {op.perm!r}, "
                    f"_swap{op.dst})")
        if isinstance(op, Reshape):
            self.shapes[op.dst] = op.shape
            if op.dst in self.exits and op.src in self.pools:
                return f"v{op.dst} = _alias(v{op.src}, {op.shape!r})"
            return f"v{op.dst} = {self.reshape(op.src, op.shape)}"
        if isinstance(op, Sum):
            self.shapes[op.dst] = tuple(s for k, s in enumerate(op.shape) if k not in op.dims)
            # integers stay in the operands' dtype (torch.sum would promote them to int64)
            keep = "" if self.dtype.is_floating_point or self.dtype.is_complex else \
                f", dtype={self.dtype}"
            return f"v{op.dst} = {self.reshape(op.src, op.shape)}.sum({op.dims!r}{keep})"
        if isinstance(op, Expand):
            self.shapes[op.dst] = op.shape
            return (f"v{op.dst} = {self.reshape(op.src, op.view)}.expand({op.shape!r})"
                    ".contiguous()")
        raise TypeError(f"unknown op {op!r}")

    def fusable(self, ops) -> dict[int, tuple[int, int]]:
        """Adjacent GEMM pairs ``V @ X`` and ``Y @ V`` sharing a large 2-D operand ``V`` with
        thin outputs, CPU only, in code that pools (the fused form writes in place): the first
        step of each pair -> (the step computing ``V @ X``, the step computing ``Y @ V``)."""
        if not self.pool or self.device.type != "cpu":
            return {}
        pairs: dict[int, tuple[int, int]] = {}
        k = 0
        while k + 1 < len(ops):
            made = ops[k].dst  # the step after may not read what step k makes
            for first, second in ((k, k + 1), (k + 1, k)):
                p, q = ops[first], ops[second]
                if self._fuses(p, q) and made not in (p.rhs.slot, q.lhs.slot):
                    pairs[k] = (first, second)
                    break
            k += 2 if k in pairs else 1
        return pairs

    def _fuses(self, p: Op, q: Op) -> bool:
        if not (isinstance(p, MatMul) and isinstance(q, MatMul)):
            return False
        v = p.lhs
        if v != q.rhs or v.t or len(v.shape) != 2:
            return False
        rows, cols = v.shape
        return (rows * cols * self.itemsize >= FUSE_MIN_BYTES and rows >= 2 * FUSE_BLOCK
                and p.rhs.rows_cols[1] <= FUSE_MAX_THIN and q.lhs.rows_cols[0] <= FUSE_MAX_THIN)

    def fused_line(self, p: MatMul, q: MatMul) -> str:
        self.shapes[p.dst] = (p.lhs.rows_cols[0], p.rhs.rows_cols[1])
        self.shapes[q.dst] = (q.lhs.rows_cols[0], q.rhs.rows_cols[1])
        self.fused += 1
        return (f"v{p.dst}, v{q.dst} = _fused_rows({self.view(p.lhs)}, {self.view(p.rhs)}, "
                f"{self.view(q.lhs)})")

    def body(self, ops, frees, which: int = 0) -> list[str]:
        lines = [f"        _mark({which}, -1)"] if self.timed else []
        pairs = self.fusable(ops)
        done = {k + 1 for k in pairs}
        for k, (op, free) in enumerate(zip(ops, frees, strict=True)):
            lines.append(f"        step = {k}")
            conjugate = self.conjugate
            self.conjugate = conjugate and op.dst > self.plan.dy_slot  # a replayed forward step
            if k in pairs:  # (memory modes) computes, not conjugates
                first, second = pairs[k]
                self.conjugate = conjugate and min(ops[first].dst, ops[second].dst) > \
                    self.plan.dy_slot
                lines.append(f"        {self.fused_line(ops[first], ops[second])}")
            elif k in done:
                lines.append("        pass  # fused into the step before")
            else:
                lines.append(f"        {self.line(op)}")
            self.conjugate = conjugate
            if free:
                lines.append(f"        del {', '.join(f'v{s}' for s in free)}")
            if self.timed:
                lines.append(f"        _mark({which}, {k})")
        return lines or ["        pass"]


def _tuple(names: list[str]) -> str:
    return "(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")"


def generate(plan: Plan, operand_shapes, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu", name: str = "plan",
             pool: bool = True, mark: Callable[[int, int], None] | None = None,
             ) -> GeneratedCode:
    """Render and compile ``plan`` into ``forward(*operands)`` and ``backward(...)``.

    ``mark``: called as ``mark(pass, -1)`` when a pass (0 forward, 1 backward) starts and
    ``mark(pass, k)`` after its step k (the per-step timer of :mod:`tncomp.runtime.profile`)."""
    emit = _Emitter(plan, [tuple(s) for s in operand_shapes], dtype, torch.device(device), pool)
    emit.timed = mark is not None
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
    bwd += emit.body(plan.backward, plan.backward_frees, 1)
    bwd += ["    except Exception as exc:", "        _fail(exc, 'backward', step)",
            f"    return {_tuple(grads)}"]
    source = "\n".join([*fwd, "", *bwd]) + "\n"

    def fail(exc: Exception, which: str, step: int) -> None:
        ops = plan.forward if which == "forward" else plan.backward
        what = ops[step].describe() if 0 <= step < len(ops) else "setup"
        raise ExecutionError(
            f"{type(exc).__name__} while executing {which} step {step} ({what}) of {name}: {exc}"
        ) from exc

    namespace = {"torch": torch, "_fail": fail, "_alias": alias, "_fused_rows": fused_rows,
                 "_permute_into": permute_into, "_mark": mark, **emit.constants}
    namespace.update({f"_pool{slot}": p for slot, p in emit.pools.items()})
    filename = f"<tncomp {name} {id(plan):x}>"
    exec(compile(source, filename, "exec"), namespace)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    return GeneratedCode(source, namespace["forward"], namespace["backward"], emit.pools,
                         emit.fused)
