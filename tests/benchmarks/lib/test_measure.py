"""The benchmarks' one timer: interleaved rounds (wall clock or CUDA events), medians with their
spread, one timed call; and no clock read anywhere else in benchmarks/."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.lib.measure import (
    interleaved_times,
    ratio_spread,
    spread,
    spread_text,
    time_call,
    timed,
)
from comera.errors import ConfigError


def test_ratio_spread_of_paired_rounds_by_hand():
    num = [2.0, 3.0, 4.0, 10.0, 6.0]
    den = [1.0, 1.0, 2.0, 2.0, 1.0]  # per-round ratios 2, 3, 2, 5, 6 -> sorted 2 2 3 5 6
    s = ratio_spread(num, den)
    assert s["ratio"] == pytest.approx(4.0 / 1.0)  # medians 4 and 1
    assert (s["min"], s["q1"], s["q3"], s["max"], s["repeats"]) == (2.0, 2.0, 5.0, 6.0, 5)
    assert spread_text(s) == "4.00x (IQR 2.00-5.00, range 2.00-6.00 over 5)"


def test_ratio_spread_of_one_round_is_that_round():
    s = ratio_spread([3.0], [2.0])
    assert s["ratio"] == s["min"] == s["q1"] == s["q3"] == s["max"] == 1.5


def test_interleaved_times_runs_in_rounds_after_warmup():
    calls: list[str] = []
    times = interleaved_times({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                              repeats=2, warmup=1)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert [len(t) for t in times.values()] == [2, 2]


@pytest.mark.parametrize("bad", [([], []), ([1.0], [1.0, 2.0])])
def test_ratio_spread_refuses_unpaired_times(bad):
    with pytest.raises(ConfigError, match="equal, non-empty"):
        ratio_spread(*bad)


def test_interleaved_times_refuses_zero_repeats():
    with pytest.raises(ConfigError, match="repeats=0"):
        interleaved_times({"a": lambda: None}, repeats=0)


def test_inner_calls_run_back_to_back_and_are_averaged_per_call():
    calls: list[str] = []
    times = interleaved_times({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                              repeats=2, warmup=0, inner=3)
    assert calls == ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3
    assert all(len(t) == 2 and all(x >= 0 for x in t) for t in times.values())


def test_time_call_reports_seconds_per_call(monkeypatch):
    clock = iter([10.0, 16.0])  # a fake clock: 6 s over 3 calls
    monkeypatch.setattr("benchmarks.lib.measure.time.perf_counter", lambda: next(clock))
    assert time_call(lambda: None, inner=3) == pytest.approx(2.0)


@pytest.mark.parametrize("kwargs", [{"repeats": 1, "inner": 0}, {"repeats": 1, "warmup": -1},
                                    {"repeats": True}])
def test_interleaved_times_refuses_bad_counts(kwargs):
    with pytest.raises(ConfigError, match="="):
        interleaved_times({"a": lambda: None}, **kwargs)


def test_spread_by_hand():
    assert spread([5.0, 1.0, 3.0, 2.0, 4.0]) == {"median": 3.0, "q1": 2.0, "q3": 4.0,
                                                 "min": 1.0, "max": 5.0, "repeats": 5}
    assert spread([7.0])["q1"] == spread([7.0])["q3"] == 7.0
    with pytest.raises(ConfigError, match="no times"):
        spread([])


def test_timed_returns_the_value_and_its_seconds():
    out = timed(lambda: sum(range(1000)))
    assert out.value == 499500 and out.seconds >= 0 and out.cpu_seconds >= 0


@pytest.mark.gpu
def test_cuda_times_are_device_times_per_call():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    a = torch.randn(1024, 1024, device="cuda")
    times = interleaved_times({"mm": lambda: a @ a}, repeats=3, warmup=1, inner=4,
                              device="cuda")
    assert len(times["mm"]) == 3 and all(0 < t < 1 for t in times["mm"])


def test_the_benchmarks_keep_no_timer_of_their_own():
    """One home: every clock read of benchmarks/ is in benchmarks/lib/measure.py (deadlines,
    time.monotonic, are not timings)."""
    root = Path(__file__).resolve().parents[3] / "benchmarks"
    clocks = ("perf_counter", "process_time", "thread_time", "cuda.Event", "time.time()")
    found = [f"{p.relative_to(root)}: {c}" for p in root.rglob("*.py")
             if p.name != "measure.py" or p.parent.name != "lib"
             for c in clocks if c in p.read_text()]
    assert not found, found
