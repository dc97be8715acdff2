"""Measured time of every step of a plan, to set beside its roofline floor.

A plan's floor (:meth:`~tncomp.compiler.plan.Plan.floor_time`) says how fast its steps could
run on a device model: each at the GEMM rate or the bandwidth, whichever binds. This module says
how fast they do run: the plan's code is generated with a clock read after every step
(``generate(..., mark=...)``; on CUDA each read synchronizes first), run on random operands and
a contiguous output gradient (as a next layer hands it; a ``.sum()`` loss would hand a stride-0
one), and each step's median over the repeats is kept. The whole pass is also timed without
the clock reads, so the per-step figures can be checked against it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from tncomp.compiler.plan import Measured, Plan
from tncomp.runtime.device_timing import median_time
from tncomp.runtime.codegen import generate

REPEATS = 7


def measure_plan(plan: Plan, shapes: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", repeats: int = REPEATS) -> Measured:
    """Run ``plan`` (forward, and backward when it takes gradients) ``repeats`` times on random
    operands of ``shapes`` after a warm-up, reading the clock after every step: the median
    seconds of each step, and of the unmarked run."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ticks: list[tuple[int, int, float]] = []

    def mark(which: int, step: int) -> None:
        sync()
        ticks.append((which, step, time.perf_counter()))

    marked = generate(plan, shapes, dtype, device, name="profile", mark=mark)
    plain = generate(plan, shapes, dtype, device, name="profile")
    operands = [torch.randn(tuple(s), dtype=dtype, device=device) for s in shapes]
    dy = torch.randn(plan.output_shape, dtype=dtype, device=device)  # contiguous, as a layer's
    with_grad = any(plan.needs_grad)

    def run(code) -> None:
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
    total = median_time(lambda: run(plain), repeats, sync)
    return Measured(tuple(statistics.median(t) for t in forward),
                    tuple(statistics.median(t) if t else 0.0 for t in backward), total,
                    repeats, torch.get_num_threads())
