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
    model = calibrate("cpu", shapes=True, threads=1)  # 1: robust on a loaded machine
    assert model.gemm_dims == (4, 16) and len(model.gemm_rates) == 8
    assert load_calibration("cpu") == model
    assert calibrate("cpu", save=False, threads=1).gemm_dims == ()  # off by default


@pytest.mark.slow  # a calibration with its table: ~5 s on 2 cores
def test_cli_calibrate_shapes_saves_the_table_inspect_floors_use(tmp_path, monkeypatch, capsys):
    import tncomp.runtime.device_timing as cal
    from tncomp.cli import main
    from tncomp.compiler.builders import tt_linear
    from tncomp.inspection import inspect

    monkeypatch.setenv("TNCOMP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cal, "GEMM_GRID", (4, 16))
    assert main(["calibrate", "--shapes", "--threads", "1"]) == 0
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


# -- issue 42, item 7: measurements taken while other work holds the cores are refused ----------
# On main, `tncomp calibrate --shapes` on a busy machine stored GEMM rates of 1 MFLOP/s and said
# compile now plans with them.

@pytest.fixture
def quick(tmp_path, monkeypatch):
    """A calibration small enough for the default run: a 512^3 square GEMM, a (4, 16) grid."""
    import tncomp.runtime.device_timing as cal

    monkeypatch.setenv("TNCOMP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cal, "SQUARE_N", 512)
    monkeypatch.setattr(cal, "GEMM_GRID", (4, 16))
    return cal


def _busy(cal, monkeypatch) -> list[int]:
    """Every GEMM of the grid loses a 1 ms time slice to other work, as a thread waiting for a
    descheduled sibling does on a loaded machine; the GEMMs themselves still run. Returns the
    list the timings are counted in."""
    calls: list[int] = []
    real = cal.best_time

    def descheduled(fn, repeats, sync):
        calls.append(1)
        return real(fn, repeats, sync) + 1e-3

    monkeypatch.setattr(cal, "best_time", descheduled)
    return calls


def test_a_busy_machines_thin_gemm_rates_are_timed_again_then_refused(quick, monkeypatch):
    from tncomp.errors import CalibrationError

    old = quick.DeviceModel(3.5e11, 2.25e10, 7e-6, "an earlier calibration")
    quick.save_calibration(old, "cpu")
    calls = _busy(quick, monkeypatch)
    with pytest.raises(CalibrationError, match=r"8 of 8 GEMM shapes ran implausibly slowly .* "
                                               r"each timed 3 times .*nothing saved"):
        calibrate("cpu", shapes=True, threads=1)
    assert len(calls) == 8 * (quick.RETRIES + 1)  # every point timed again twice
    assert load_calibration("cpu") == old  # the old file stands


def test_the_cli_refuses_a_busy_calibration_in_one_line(quick, monkeypatch, capsys):
    from tncomp.cli import main

    _busy(quick, monkeypatch)
    assert main(["calibrate", "--shapes", "--threads", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith("tncomp: error: 8 of 8 GEMM shapes ran implausibly slowly")
    assert "nothing saved; run it again when the machine is idle." in err
    assert not quick.calibration_path("cpu").exists()


def test_an_idle_calibration_at_one_thread_is_saved(quick):
    before = torch.get_num_threads()
    model = calibrate("cpu", shapes=True, threads=1)
    assert torch.get_num_threads() == before  # restored
    assert model.source == "calibrated on cpu (torch.float32, 1 threads)"
    assert model.implausible_rates() == [] and load_calibration("cpu") == model


def test_check_calibration_names_the_fault_and_the_fix():
    from tncomp.compiler.device_model import DeviceModel
    from tncomp.errors import CalibrationError
    from tncomp.runtime.device_timing import SQUARE_SPREAD, check_calibration

    grid = (8, 64)
    rates = [2 * m * n * k / (2 * m * n * k / 5e10 + 2e-6) for m in grid for n in grid
             for k in grid]  # each at the square rate plus the overhead: plausible
    good = DeviceModel(5e10, 1e10, 2e-6, "calibrated on cpu (torch.float32, 2 threads)", grid,
                       tuple(rates))
    check_calibration(good, 5e10 * SQUARE_SPREAD * 0.99, threads=2)  # raises nothing
    with pytest.raises(CalibrationError, match=r"ran at 50 GFLOP/s at the start .* and at 10 "
                                               r"GFLOP/s at its end .*--threads 1"):
        check_calibration(good, 1e10, threads=2)
    with pytest.raises(CalibrationError, match=r"idle\.$"):  # one thread: no --threads advice
        check_calibration(good, 1e10, threads=1)
    rates[0] = 1e6  # the 1 MFLOP/s
    busy = DeviceModel(5e10, 1e10, 2e-6, "busy", grid, tuple(rates))
    with pytest.raises(CalibrationError, match=r"1 of 8 GEMM shapes .*\(8x8\)@\(8x8\) at 1 "
                                               r"MFLOP/s"):
        check_calibration(busy, 5e10, threads=1)


@pytest.mark.parametrize("threads", [0, -1, 1.0, "2", True, 10**6])
def test_a_bad_thread_count_is_refused_naming_it(threads):
    from tncomp.errors import OptionError
    from tncomp.runtime.device_timing import check_threads, usable_cpus

    with pytest.raises(OptionError, match=rf"threads={threads!r}; give a number of threads "
                                          rf"from 1 to {usable_cpus()}"):
        calibrate("cpu", save=False, threads=threads)
    with pytest.raises(OptionError):
        check_threads(threads)
