"""Autotune: time candidate plans on the device, so the planner can keep the fastest.

The device model ranks candidates; measurement settles the top few, since FLOP-optimal (and
even model-optimal) is not time-optimal. The planner (:mod:`tncomp.compiler.planner`) picks
the candidates, keys and stores the winner; this module only runs plans and times them: values
in (plans, shapes, dtype, device), seconds out.

It also picks the orientation of the winner's heaviest GEMMs (:func:`orient_gemms`): ``C = A B``
or ``C = (B^T A^T)^T``, the same values from the other BLAS orientation. CPU BLAS is far from
symmetric on thin shapes (either orientation can be several times the other:
docs/results.md, "Measured rules of the CPU executor"), and no rule of thumb predicts which way
wins, so each is timed in isolation on operands of its own layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tncomp.compiler.ops import MatMul, MatView
from tncomp.compiler.plan import Plan
from tncomp.runtime.codegen import generate, runs_transposed
from tncomp.runtime.device_timing import device_sync, median_time, time_calls, upper_median

REPEATS = 5
ORIENT_TOP = 6  # the heaviest GEMMs whose orientation is measured
ORIENT_ROUNDS = 7  # interleaved rounds per GEMM (median of each orientation)
ORIENT_MARGIN = 0.9  # transposed is kept only when it takes under 90% of the direct time


def _time_plan(plan: Plan, shapes, dtype, device, repeats: int = REPEATS) -> float:
    code = generate(plan, shapes, dtype, device, name="autotune", pool=True)
    operands = [torch.randn(s, dtype=dtype, device=device) for s in shapes]
    dy = torch.randn(plan.output_shape, dtype=dtype, device=device)
    sync = device_sync(device)

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


def _matrix(view: MatView, dtype, device) -> torch.Tensor:
    """A random operand stored as ``view`` reads it: ``view.shape`` contiguous, its batch axis
    moved first, transposed if ``view.t``."""
    stored = torch.randn(view.shape, dtype=dtype, device=device)
    if view.batch_axis:  # a strided batch
        stored = stored.permute(1, 0, 2)
    return stored.mT if view.t else stored


def gemm_times(op: MatMul, dtype: torch.dtype, device: torch.device | str,
               rounds: int = ORIENT_ROUNDS) -> tuple[float, float]:
    """Median seconds of ``op`` run as ``lhs @ rhs`` and as ``(rhs^T @ lhs^T)^T`` copied
    contiguous, timed in alternation on random operands of its layout, results written into
    reused buffers."""
    device = torch.device(device)
    a, b = _matrix(op.lhs, dtype, device), _matrix(op.rhs, dtype, device)
    fn = torch.bmm if a.dim() == 3 else torch.mm
    # into reused buffers, as codegen runs them (pooled): fresh outputs would charge both
    # orientations page faults the plan does not pay (a 4096x3072 result measured faster
    # transposed in isolation and made the step 8x slower)
    res = fn(a, b)  # (..., m, n)
    res_t = torch.empty(res.mT.shape, dtype=dtype, device=device)  # (..., n, m)
    times = time_calls({"direct": lambda: fn(a, b, out=res),
                        "transposed": lambda: res.copy_(fn(b.mT, a.mT, out=res_t).mT)},
                       1, rounds, device_sync(device))
    return upper_median(times["direct"]), upper_median(times["transposed"])


def orient_gemms(plan: Plan, dtype: torch.dtype, device: torch.device | str,
                 top: int = ORIENT_TOP) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Positions of the forward and of the backward GEMMs of ``plan`` (among its ``top``
    heaviest) that run measurably faster transposed (:func:`gemm_times`, under
    ``ORIENT_MARGIN`` of the direct time): the planner marks them :attr:`MatMul.transposed`
    and keeps the choice with the autotuned tree."""
    device = torch.device(device)
    gemms = [(op.flops, which, k, op)
             for which, ops in enumerate((plan.forward, plan.backward))
             for k, op in enumerate(ops)
             if isinstance(op, MatMul) and not runs_transposed(op, device)]
    gemms.sort(key=lambda g: -g[0])
    chosen: tuple[list[int], list[int]] = ([], [])
    for _, which, k, op in gemms[:top]:
        direct, transposed = gemm_times(op, dtype, device)
        if transposed < ORIENT_MARGIN * direct:
            chosen[which].append(k)
    return tuple(chosen[0]), tuple(chosen[1])
