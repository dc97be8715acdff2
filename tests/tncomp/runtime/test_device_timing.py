"""The measured GEMM table of a calibration: one positive rate per grid point, the square rate
above the FLOP cap, and a model that round-trips through the calibration file."""

import pytest
import torch

from tncomp.runtime.device_timing import calibrate, gemm_table, load_calibration


def test_gemm_table_measures_every_grid_point_below_the_cap():
    grid = (4, 16)
    cap = 2 * 16 * 16 * 4
    rates = gemm_table(torch.device("cpu"), torch.float32, lambda: None, peak=123.0,
                       overhead=1e-7, grid=grid, max_flops=cap, repeats=1)
    assert len(rates) == 8 and all(r > 0 for r in rates)
    points = [(m, n, k) for m in grid for n in grid for k in grid]
    for (m, n, k), r in zip(points, rates, strict=True):
        assert (r == 123.0) == (2 * m * n * k > cap)


@pytest.mark.slow  # two full calibrations: ~10 s on 2 cores
def test_calibrate_with_shapes_saves_a_table(tmp_path, monkeypatch):
    import tncomp.runtime.device_timing as cal

    monkeypatch.setenv("TNCOMP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cal, "GEMM_GRID", (4, 16))
    model = calibrate("cpu", shapes=True)
    assert model.gemm_dims == (4, 16) and len(model.gemm_rates) == 8
    assert load_calibration("cpu") == model
    assert calibrate("cpu", save=False).gemm_dims == ()  # off by default


@pytest.mark.slow  # a calibration with its table: ~5 s on 2 cores
def test_cli_calibrate_shapes_saves_the_table_inspect_floors_use(tmp_path, monkeypatch, capsys):
    import tncomp.runtime.device_timing as cal
    from tncomp.cli import main
    from tncomp.compiler.builders import tt_linear
    from tncomp.inspection import inspect

    monkeypatch.setenv("TNCOMP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cal, "GEMM_GRID", (4, 16))
    assert main(["calibrate", "--shapes"]) == 0
    assert "GEMM rates over 8 shapes from 4 to 16" in capsys.readouterr().out
    model = load_calibration("cpu")
    assert model.gemm_dims == (4, 16) and len(model.gemm_rates) == 8
    # inspect's floors come from the saved table: a GEMM's floor is at its shape's rate
    net = tt_linear((4, 4), (4, 4), 2)
    text = inspect(net, batch=64)
    assert "floor" in text
    from tncomp.api import compile as tn_compile
    plan = tn_compile(net).plan_for({"b": 64, **{i: s for i, s in net.sizes
                                                  if isinstance(s, int)}},
                                    (True,) * len(net.operands))
    flat = type(model)(model.gemm_flops_per_s, model.bytes_per_s, model.step_overhead_s)
    assert plan.floor_time(model) != plan.floor_time(flat)
