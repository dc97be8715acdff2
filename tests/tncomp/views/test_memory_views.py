"""What ``tncomp inspect`` and ``plot-costs`` show of a memory mode: saved bytes, recomputation."""

from __future__ import annotations

import pytest

import tncomp
from tncomp.cli import main

SPEC = "tt:64x64:modes=4,4,4|4,4,4:rank=16"


def test_inspect_shows_what_each_mode_saves_and_recomputes(capsys):
    net = tncomp.tt_linear((4, 4, 4), (4, 4, 4), 16)
    sizes = {i: (16 if not isinstance(s, int) else s) for i, s in net.sizes}
    fast_plan = tncomp.compile(net, disk_cache=False).plan_for(sizes, (True,) * 7)
    assert fast_plan.saved
    assert main(["inspect", SPEC, "--batch", "16", "--memory", "min"]) == 0
    low = capsys.readouterr().out
    assert "== memory (mode min; plan at B=16) ==" in low
    assert "saved 0.00 MiB (0 values)" in low
    assert f"recompute       {len(fast_plan.saved)} values" in low
    assert main(["inspect", SPEC, "--batch", "16"]) == 0
    fast = capsys.readouterr().out
    assert "mode fast" in fast and "recompute       0 values, 0 steps, 0.00 MFLOP" in fast
    assert (f"saved {fast_plan.saved_bytes / 2**20:.2f} MiB ({len(fast_plan.saved)} values)"
            in fast)


@pytest.mark.parametrize("memory", ["fast", "min", 0])
def test_cost_curves_size_every_plan_under_the_mode(memory):
    net = tncomp.tt_linear((4, 4), (4, 4), 8)
    curves = tncomp.cost_curves(net, (1, 64), points=4, memory=memory)
    assert curves.memory == memory
    for series in curves.candidates:
        assert len(series.saved) == len(curves.batches)
        assert all(v == 0 for v in series.saved) == (memory != "fast")
    fast = tncomp.cost_curves(net, (1, 64), points=4)
    for low, full in zip(curves.candidates, fast.candidates, strict=True):
        assert all(a <= b for a, b in zip(low.saved, full.saved, strict=True))
        assert all(a >= b for a, b in zip(low.times, full.times, strict=True))


def test_plot_costs_draws_the_memory_panel(tmp_path, capsys):
    out = tmp_path / "costs.png"
    assert main(["plot-costs", "tt:16x16:modes=4,4|4,4:rank=4", "-o", str(out),
                 "--batch-range", "1", "64",
                 "--memory", "balanced"]) == 0
    assert out.stat().st_size > 0
    assert "wrote" in capsys.readouterr().out
