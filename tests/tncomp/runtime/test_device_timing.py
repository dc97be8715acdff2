"""The measured GEMM table of a calibration: one positive rate per grid point, the square rate
above the FLOP cap, and a model that round-trips through the calibration file."""

import ast
import time
from pathlib import Path

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


def test_time_calls_warms_up_then_times_round_robin(monkeypatch):
    import tncomp.runtime.device_timing as cal

    clock = iter(float(t) for t in range(100))  # each clock read one second later
    monkeypatch.setattr(cal.time, "perf_counter", lambda: next(clock))
    events: list[str] = []
    fns = {"a": lambda: events.append("a"), "b": lambda: events.append("b")}
    times = cal.time_calls(fns, 2, 3, sync=lambda: events.append("sync"),
                           before=lambda key: events.append(f"set {key}"))
    assert times == {"a": [1.0] * 3, "b": [1.0] * 3}  # start and stop are consecutive reads
    warm = ["set a", "a", "set a", "a", "set b", "b", "set b", "b"]
    rounds = ["set a", "sync", "a", "sync", "set b", "sync", "b", "sync"] * 3
    assert events == warm + rounds  # the device drained before each start and each stop


def test_time_calls_times_what_the_call_queues():
    import tncomp.runtime.device_timing as cal

    queued: list[float] = []  # a device queue the call fills and only sync drains

    def drain() -> None:
        while queued:
            time.sleep(queued.pop())

    times = cal.time_calls({"f": lambda: queued.append(0.02)}, 0, 2, sync=drain)["f"]
    assert min(times) >= 0.02  # the call's queued work counts in its time


@pytest.mark.parametrize("warmup, repeats", [(-1, 1), (0, 0), (True, 1), (0, 1.5)])
def test_time_calls_refuses_bad_counts(warmup, repeats):
    from tncomp.errors import OptionError
    from tncomp.runtime.device_timing import time_calls

    with pytest.raises(OptionError, match=r"(warmup|repeats)=.*whole number"):
        time_calls({"f": lambda: None}, warmup, repeats)


def test_median_and_best_time_reduce_the_one_timer(monkeypatch):
    import tncomp.runtime.device_timing as cal

    gaps = iter([5.0, 1.0, 3.0, 2.0])  # seconds of the four timed calls, in order
    now = [0.0]

    def clock() -> float:
        now[0] += next(gaps) if len(ticks) % 2 else 0.0
        ticks.append(now[0])
        return now[0]

    ticks: list[float] = []
    monkeypatch.setattr(cal.time, "perf_counter", clock)
    assert cal.median_time(lambda: None, 4, cal.no_sync) == 3.0  # the upper of 2 and 3
    assert cal.upper_median([1.0, 2.0, 3.0]) == 2.0
    gaps = iter([4.0, 0.5, 2.0])
    assert cal.best_time(lambda: None, 3, cal.no_sync) == 0.5


def test_device_sync_waits_only_on_cuda():
    from tncomp.runtime.device_timing import device_sync, no_sync

    assert device_sync("cpu") is no_sync
    assert device_sync(torch.device("meta")) is no_sync


# Clock reads in tncomp/ and comera/ outside the timer's home that are not timing loops, by
# (module, function), each with its reason.
NOT_TIMING_LOOPS = {
    ("comera/experiments/engine.py", "train_step"): "wall-clock bookkeeping of a run "
                                                    "(RunRecord.train_seconds)",
    ("comera/experiments/engine.py", "_train_step"): "each real training step's own time "
                                                     "(RunRecord.step_times), taken once",
    ("tncomp/compiler/budget.py", "__init__"): "a planning deadline, not a timing",
    ("tncomp/compiler/budget.py", "remaining"): "a planning deadline, not a timing",
    ("tncomp/compiler/budget.py", "spent"): "a planning deadline, not a timing",
    ("tncomp/compiler/budget.py", "check"): "a planning deadline, not a timing",
    ("tncomp/compiler/cache.py", "_sweep_temps"): "a temp file's age against its mtime "
                                                   "(time.time), not a timing",
    ("tncomp/files.py", "sweep_temp_files"): "a temp file's age against its mtime (time.time), "
                                             "not a timing",
    ("tncomp/runtime/profile.py", "mark"): "a profiler's tick between the steps of one traced "
                                           "call (the totals it checks against come from "
                                           "median_time)",
}
TIMER_HOME = "tncomp/runtime/device_timing.py"
CLOCKS = {"perf_counter", "perf_counter_ns", "process_time", "process_time_ns", "monotonic",
          "monotonic_ns", "time", "time_ns"}


def clock_reads(path: Path, root: Path) -> list[tuple[str, str, int]]:
    """``(module, enclosing function, line)`` of every call of a clock of :mod:`time`
    (``time.perf_counter()``, or a name imported from :mod:`time`) in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    imported = {a.asname or a.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module == "time"
                for a in node.names if a.name in CLOCKS}
    found = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = (child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
                     else where)
            if isinstance(child, ast.Call):
                f = child.func
                if ((isinstance(f, ast.Attribute) and f.attr in CLOCKS
                     and isinstance(f.value, ast.Name) and f.value.id == "time")
                        or (isinstance(f, ast.Name) and f.id in imported)):
                    found.append((path.relative_to(root).as_posix(), where, child.lineno))
            visit(child, inner)

    visit(tree, "<module>")
    return found


def test_the_library_keeps_one_timer():
    """tncomp and comera time calls in one loop, :func:`time_calls`: a clock read elsewhere is
    a second timer, unless it is named in NOT_TIMING_LOOPS with its reason."""
    root = Path(__file__).resolve().parents[3]
    reads = [r for package in ("tncomp", "comera") for p in sorted((root / package).rglob("*.py"))
             for r in clock_reads(p, root)]
    assert any(module == TIMER_HOME for module, _, _ in reads)  # the scan sees the timer
    stray = [f"{module}:{line} in {where}()" for module, where, line in reads
             if module != TIMER_HOME and (module, where) not in NOT_TIMING_LOOPS]
    assert not stray, ("clock reads outside tncomp.runtime.device_timing; time calls with "
                       f"time_calls (or name a non-timing read in NOT_TIMING_LOOPS): {stray}")
    unused = {k for k in NOT_TIMING_LOOPS if k not in {(m, w) for m, w, _ in reads}}
    assert not unused, f"NOT_TIMING_LOOPS names reads that are gone: {unused}"


def test_the_clock_scan_finds_a_timing_loop(tmp_path):
    planted = tmp_path / "pkg" / "loop.py"
    planted.parent.mkdir()
    planted.write_text("import time\nfrom time import perf_counter as pc\n\n"
                       "def f(fn):\n    t = time.perf_counter()\n    fn()\n"
                       "    return pc() - t\n")
    assert clock_reads(planted, tmp_path) == [("pkg/loop.py", "f", 5), ("pkg/loop.py", "f", 7)]


@pytest.mark.gpu
def test_time_calls_on_cuda_holds_the_queued_kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tncomp.runtime.device_timing import device_sync, time_calls

    a = torch.randn(4096, 4096, device="cuda")
    sync = device_sync("cuda")
    start, stop = (torch.cuda.Event(enable_timing=True) for _ in range(2))

    def mm() -> None:
        for _ in range(4):
            a @ a

    mm()
    sync()
    start.record()
    mm()
    stop.record()
    stop.synchronize()
    device_s = start.elapsed_time(stop) / 1e3
    host_s = min(time_calls({"mm": mm}, 1, 3, sync)["mm"])
    assert host_s >= 0.8 * device_s  # without the sync it would time the launches alone
