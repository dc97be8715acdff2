"""Turn a :class:`~tncomp.plan.Plan` into two straight-line Python functions over torch.

Like torch.fx, the plan is rendered as source (one line per step, freeing each value after its
last use) and compiled once, so a cached plan runs with no interpreter loop. A failure re-raises
as :class:`ExecutionError` naming the pass, the step and what it computes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tncomp.errors import ExecutionError
from tncomp.ops import Expand, MatMul, MatView, Op, Permute, Reshape, Sum
from tncomp.plan import Plan


def _view(v: MatView) -> str:
    text = f"v{v.slot}.reshape({v.shape!r})"
    return f"{text}.mT" if v.t else text


def _line(op: Op) -> str:
    if isinstance(op, MatMul):
        fn = "bmm" if len(op.lhs.shape) == 3 else "mm"
        return f"v{op.dst} = torch.{fn}({_view(op.lhs)}, {_view(op.rhs)})"
    if isinstance(op, Permute):
        return f"v{op.dst} = v{op.src}.reshape({op.shape!r}).permute({op.perm!r}).contiguous()"
    if isinstance(op, Reshape):
        return f"v{op.dst} = v{op.src}.reshape({op.shape!r})"
    if isinstance(op, Sum):
        return f"v{op.dst} = v{op.src}.reshape({op.shape!r}).sum({op.dims!r})"
    if isinstance(op, Expand):
        return f"v{op.dst} = v{op.src}.reshape({op.view!r}).expand({op.shape!r}).contiguous()"
    raise TypeError(f"unknown op {op!r}")


@dataclass(frozen=True)
class GeneratedCode:
    """The source and the compiled functions of one plan."""

    source: str
    forward: Callable
    backward: Callable


def _body(ops: Sequence[Op], frees: Sequence[tuple[int, ...]], indent: str) -> list[str]:
    lines = []
    for k, (op, free) in enumerate(zip(ops, frees, strict=True)):
        lines.append(f"{indent}step = {k}")
        lines.append(f"{indent}{_line(op)}")
        if free:
            lines.append(f"{indent}del {', '.join(f'v{s}' for s in free)}")
    return lines


def generate(plan: Plan, name: str = "plan") -> GeneratedCode:
    """Render and compile ``plan`` into ``forward(*operands)`` and ``backward(...)``."""
    n = plan.n_operands
    args = ", ".join(f"v{k}" for k in range(n)) + ("," if n == 1 else "")
    saved = ", ".join(f"v{s}" for s in plan.saved) + ("," if len(plan.saved) == 1 else "")
    fwd = [f"def forward({args}):", "    step = -1", "    try:"]
    fwd += _body(plan.forward, plan.forward_frees, "        ")
    fwd += [f"    except Exception as exc:",
            f"        _fail(exc, 'forward', step)",
            f"    return v{plan.output_slot}, ({saved})"]
    grads = ", ".join("None" if s is None else f"v{s}" for s in plan.grad_slots)
    bwd = [f"def backward(operands, saved, v{plan.dy_slot}):",
           f"    ({args}) = operands",
           f"    ({saved}) = saved" if plan.saved else "    pass",
           "    step = -1", "    try:"]
    bwd += _body(plan.backward, plan.backward_frees, "        ") or ["        pass"]
    bwd += ["    except Exception as exc:",
            "        _fail(exc, 'backward', step)",
            f"    return ({grads}{',' if n == 1 else ''})"]
    source = "\n".join(fwd + [""] + bwd) + "\n"

    def fail(exc: Exception, which: str, step: int) -> None:
        ops = plan.forward if which == "forward" else plan.backward
        what = ops[step].describe() if 0 <= step < len(ops) else "setup"
        raise ExecutionError(
            f"{type(exc).__name__} while executing {which} step {step} ({what}) of {name}: {exc}"
        ) from exc

    namespace = {"torch": torch, "_fail": fail}
    filename = f"<tncomp {name}>"
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own generated code
    sys.modules.get("linecache") and _register_source(filename, source)
    return GeneratedCode(source, namespace["forward"], namespace["backward"])


def _register_source(filename: str, source: str) -> None:
    """Let tracebacks show the generated lines."""
    import linecache

    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
