"""The benchmark harness's timing summaries: interleaved rounds and the spread of a ratio."""

from __future__ import annotations

import pytest

from benchmarks.lib.measure import interleaved_times, ratio_spread, spread_text
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
