"""The per-step clock of a plan: one time per step, both passes, and marked code computing the
same values as the plain code."""

from __future__ import annotations

import torch

import tncomp
from tests.helpers.tn import bind, operands
from tncomp.runtime.codegen import generate
from tncomp.runtime.profile import measure_plan


def _plan():
    net = tncomp.tt_linear([4, 8], [8, 4], 4)
    plan = tncomp.compile(net, disk_cache=False).plan_for(bind(net, 32), (True,) * 5)
    return net, plan


def test_one_time_per_step_of_each_pass():
    net, plan = _plan()
    shapes = [tuple(t.shape) for t in operands(net, 32)]
    m = measure_plan(plan, shapes, repeats=3)
    assert len(m.forward) == len(plan.forward) and len(m.backward) == len(plan.backward)
    assert all(t >= 0 for t in (*m.forward, *m.backward)) and m.total > 0
    assert m.repeats == 3 and m.threads == torch.get_num_threads()
    assert m.steps_total == sum(m.forward) + sum(m.backward)


def test_marked_code_reads_the_clock_after_every_step_and_computes_the_same():
    net, plan = _plan()
    ts = operands(net, 32, dtype=torch.float32)
    shapes = [tuple(t.shape) for t in ts]
    marks: list[tuple[int, int]] = []
    marked = generate(plan, shapes, mark=lambda which, step: marks.append((which, step)))
    plain = generate(plan, shapes)
    y, saved = marked.forward(*ts)
    y0, saved0 = plain.forward(*ts)
    dy = torch.randn_like(y)
    grads = marked.backward(ts, saved, dy)
    assert torch.equal(y, y0)
    for g, g0 in zip(grads, plain.backward(ts, saved0, dy), strict=True):
        assert torch.equal(g, g0)
    assert marks == [(0, -1), *((0, k) for k in range(len(plan.forward))),
                     (1, -1), *((1, k) for k in range(len(plan.backward)))]
