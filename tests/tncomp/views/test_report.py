"""The report's comparison with dense says "more" when the plan needs more (issue 24).

On main, ``tncomp inspect`` of a TT-matrix 1024x1024 layer at rank 24 printed "plan 3.38 GFLOP
vs dense 3.22 (1.0x fewer)"; the ratio was dense / plan whichever was larger.
"""

from __future__ import annotations

import re

import pytest

import tncomp
from tests.helpers.tn import bind
from tncomp.views.report import versus


@pytest.mark.parametrize(("ours", "dense", "text"), [
    (1.0, 20.0, "20.0x fewer"),
    (3.38, 3.22, "1.05x more"),
    (3.22, 3.38, "1.05x fewer"),
    (2.0, 1.0, "2.0x more"),
    (1.0, 1.0, "the same"),
    (1.0001, 1.0, "about the same (more)"),
    (0.0, 5.0, "fewer"),
])
def test_versus_says_fewer_or_more(ours, dense, text):
    assert versus(ours, dense) == text


def test_a_plan_with_more_flops_than_dense_says_more():
    # a TT-matrix layer at full rank needs more FLOPs than its dense weight
    net = tncomp.ttm_linear([4, 4], [4, 4], 16)
    text = tncomp.inspect(net, batch=64, disk_cache=False)
    line = next(s for s in text.splitlines() if s.startswith("at B=64: dense"))
    scale = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    dense, plan = (float(v) * scale[p] for v, p in re.findall(r"([0-9.]+) ([kMGT]?)FLOP", line))
    assert plan > dense
    assert re.search(r"\([0-9.]+x more\)$", line), line
    assert "fewer)" not in line


def test_every_step_shows_its_roofline_floor_and_measured_time_beside_it():
    """Issue 32: ``tncomp inspect`` shows the roofline floor of each step (FLOPs at the GEMM
    rate or bytes at bandwidth, whichever binds), and with measure=True the time each took."""
    net = tncomp.tt_linear([4, 8], [8, 4], 4)
    model = tncomp.DeviceModel(1e9, 1e9, 1e-6, "test model")
    compiled = tncomp.compile(net, model=model, disk_cache=False)
    text = tncomp.inspect(compiled, batch=64)
    plan_part = text[text.index("== plan at"):]
    header = plan_part.splitlines()[1]
    assert "floor ms" in header and "x floor" not in header
    plan = compiled.plan_for(bind(net, 64), (True,) * 5)
    floor = plan.floor_time(model)
    assert f"roofline floor {floor * 1e3:.3f} ms" in text
    first = plan.forward[0]
    row = next(line for line in plan_part.splitlines() if line.startswith("fwd   0"))
    assert row.split()[-1] == f"{model.step_floor(first) * 1e3:.3f}"
    measured = tncomp.inspect(compiled, batch=64, measure=True)
    header = measured[measured.index("== plan at"):].splitlines()[1]
    assert header.split()[-3:] == ["ms", "x", "floor"]
    assert re.search(r"measured \d+\.\d+ ms, \d+\.\dx the floor \(median of 7 runs",
                     measured)
