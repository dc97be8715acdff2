"""Autotune: time candidate plans on the device, so the planner can keep the fastest.

The device model ranks candidates; measurement settles the top few, since FLOP-optimal (and
even model-optimal) is not time-optimal. The planner (:mod:`tncomp.compiler.planner`) picks
the candidates, keys and stores the winner; this module only runs plans and times them: values
in (plans, shapes, dtype, device), seconds out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tncomp.compiler.plan import Plan
from tncomp.runtime.calibrate import median_time
from tncomp.runtime.codegen import generate

REPEATS = 5


def _time_plan(plan: Plan, shapes, dtype, device, repeats: int = REPEATS) -> float:
    code = generate(plan, shapes, dtype, device, name="autotune", pool=True)
    operands = [torch.randn(s, dtype=dtype, device=device) for s in shapes]
    dy = torch.randn(plan.output_shape, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def step():
        y, saved = code.forward(*operands)
        if any(plan.needs_grad):
            code.backward(operands, saved, dy)
        return y

    return median_time(step, repeats, sync)


def time_plans(plans: Sequence[Plan], shapes: Sequence[tuple[int, ...]], dtype: torch.dtype,
               device: torch.device | str) -> list[float]:
    """Median seconds of each plan's forward (+ backward when it takes gradients) on random
    operands of ``shapes``: the planner's timer when ``compile(..., autotune=True)``."""
    return [_time_plan(plan, shapes, dtype, device) for plan in plans]
