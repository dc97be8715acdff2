"""Measured time of every step of a plan, to set beside its roofline floor.

A plan's floor (:meth:`~tncomp.compiler.plan.Plan.floor_time`) says how fast its steps could
run on a device model: each at the GEMM rate or the bandwidth, whichever binds. This module says
how fast they do run: the plan's code is generated with a clock read after every step
(``generate(..., mark=...)``; on CUDA each read synchronizes first), run on random operands and
a contiguous output gradient (as a next layer hands it; a ``.sum()`` loss would hand a stride-0
one), and each step's median over the repeats is kept. The whole pass is also timed without
the clock reads, so the per-step figures can be checked against it.

Before anything is allocated, the bytes a measurement holds (the operands, the output gradient
and the plan's peak) are checked against the memory limit ``compile`` plans under
(:class:`~tncomp.errors.MemoryLimitError`). Given a device model, a run far slower than the
model predicts (:data:`~tncomp.compiler.device_model.PLAUSIBLE_SLOWDOWN` times its modelled
time) is measured again, and a :class:`MeasurementWarning` says so when the second run is no
better: the cores were busy, or more threads were asked for than were free.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Sequence

import torch

from tncomp.compiler.device_model import PLAUSIBLE_SLOWDOWN, DeviceModel
from tncomp.compiler.memory import MEMORY_LIMIT_ENV
from tncomp.compiler.plan import Measured, Plan
from tncomp.errors import MemoryLimitError
from tncomp.runtime.codegen import GeneratedCode, generate
from tncomp.runtime.device_timing import median_time

__all__ = ["REPEATS", "MeasurementWarning", "measure_plan", "measurement_bytes"]

REPEATS = 7


class MeasurementWarning(UserWarning):
    """A measured plan ran far slower than its device model predicts, twice: the times say more
    about the machine's load (or a device model far from the machine) than about the plan."""


def measurement_bytes(plan: Plan, shapes: Sequence[Sequence[int]], itemsize: int) -> int:
    """Bytes :func:`measure_plan` holds at once: the random operands of ``shapes``, the output
    gradient, and the plan's peak (:attr:`~tncomp.compiler.plan.Plan.peak_bytes`)."""
    operands = sum(math.prod(s) for s in shapes) * itemsize
    return operands + math.prod(plan.output_shape) * itemsize + plan.peak_bytes


def measure_plan(plan: Plan, shapes: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", repeats: int = REPEATS, *,
                 memory_limit: int | None = None, model: DeviceModel | None = None) -> Measured:
    """Run ``plan`` (forward, and backward when it takes gradients) ``repeats`` times on random
    operands of ``shapes`` after a warm-up, reading the clock after every step: the median
    seconds of each step, and of the unmarked run.

    ``memory_limit`` (bytes, e.g. ``CompiledNetwork.memory_limit(device)``): a
    :class:`MemoryLimitError` before anything is allocated when the measurement would hold more
    (:func:`measurement_bytes`). ``model``: a run over
    :data:`~tncomp.compiler.device_model.PLAUSIBLE_SLOWDOWN` times ``plan``'s modelled time is
    measured again and the faster kept; a :class:`MeasurementWarning` when it stays over."""
    need = measurement_bytes(plan, shapes, torch.empty((), dtype=dtype).element_size())
    if memory_limit is not None and need > memory_limit:
        raise MemoryLimitError(
            f"measuring this plan (operands {', '.join(str(tuple(s)) for s in shapes)}) would "
            f"hold {_mib(need)}: the operands, the output gradient and the plan's peak "
            f"{_mib(plan.peak_bytes)}; the memory limit is {_mib(memory_limit)}. Measure at a "
            "smaller batch or size, or raise the limit with compile(..., memory_limit=BYTES) "
            f"or ${MEMORY_LIMIT_ENV}.")
    measured = _measured(plan, shapes, dtype, torch.device(device), repeats)
    if model is None:
        return measured
    modelled = plan.modelled_time(model)
    if measured.total <= PLAUSIBLE_SLOWDOWN * modelled:
        return measured
    again = _measured(plan, shapes, dtype, torch.device(device), repeats)
    best = min(measured, again, key=lambda m: m.total)
    if best.total > PLAUSIBLE_SLOWDOWN * modelled:
        warnings.warn(MeasurementWarning(
            f"the plan ran {best.total / modelled:.0f}x its modelled time "
            f"({best.total * 1e3:.3g} ms against {modelled * 1e3:.3g} ms) in both of two "
            f"measurements at {best.threads} threads: other work held the cores, or the device "
            f"model ({model.source}) is far from this machine; measure again on an idle machine"
            + (", or with fewer threads (--threads 1)" if best.threads > 1 else "")
            + ", or recalibrate (tncomp calibrate)."), stacklevel=2)
    return best


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.2f} MiB"


def _measured(plan: Plan, shapes: Sequence[Sequence[int]], dtype: torch.dtype,
              device: torch.device, repeats: int) -> Measured:
    """One measurement of :func:`measure_plan`."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ticks: list[tuple[int, int, float]] = []

    def mark(which: int, step: int) -> None:
        sync()
        ticks.append((which, step, time.perf_counter()))

    marked = generate(plan, shapes, dtype, device, name="profile", mark=mark)
    operands = [torch.randn(tuple(s), dtype=dtype, device=device) for s in shapes]
    dy = torch.randn(plan.output_shape, dtype=dtype, device=device)  # contiguous, as a layer's
    with_grad = any(plan.needs_grad)

    def run(code: GeneratedCode) -> None:
        _y, saved = code.forward(*operands)
        if with_grad:
            code.backward(operands, saved, dy)

    forward: list[list[float]] = [[] for _ in plan.forward]
    backward: list[list[float]] = [[] for _ in plan.backward]
    run(marked)
    for _ in range(repeats):
        ticks.clear()
        run(marked)
        last = {}
        for which, step, clock in ticks:
            if step >= 0:
                (forward if which == 0 else backward)[step].append(clock - last[which])
            last[which] = clock
    del marked  # and its pooled buffers: the plain code pools its own
    plain = generate(plan, shapes, dtype, device, name="profile")
    total = median_time(lambda: run(plain), repeats, sync)
    return Measured(tuple(statistics.median(t) for t in forward),
                    tuple(statistics.median(t) if t else 0.0 for t in backward), total,
                    repeats, torch.get_num_threads())
