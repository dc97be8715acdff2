"""A study's results: runs files merged, the learning rate chosen on validation per method
from one grid (the edge said), and the curves plot."""

from __future__ import annotations

import json

import pytest

from benchmarks.studies.harness.results import (
    RunsFile,
    at_best_lr,
    best_lrs,
    by_method,
    merge,
    plot_curves,
)


def _row(seed, method, lr, val, target=8.0):
    curves = {"train": [[0, 5.0]], "val": [[0, 0.0, {"loss": val + 1}], [4, 2.5, {"loss": val}]]}
    return {"seed": seed, "method": method, "target": target, "lr": lr,
            "val": {"loss": val}, "test": {"loss": val + 0.1}, "curves": curves}


def test_each_method_takes_the_rate_of_its_best_mean_validation_score():
    rows = [_row(s, "tt", lr, val + s / 100) for s in (0, 1)
            for lr, val in ((1e-3, 4.5), (3e-3, 4.2), (1e-2, 4.4))]
    chosen, how = at_best_lr(rows, lambda r: r["val"]["loss"])
    assert {r["lr"] for r in chosen} == {3e-3} and len(chosen) == 2
    assert how == "0.003 of 0.001..0.01"
    two = [r for r in rows if r["lr"] < 5e-3]  # 1e-3 and 3e-3 only
    edge, how = at_best_lr(two, lambda r: r["val"]["loss"])
    assert how.endswith("at the edge") and {r["lr"] for r in edge} == {3e-3}
    assert best_lrs(rows, lambda r: r["val"]["loss"], lower=False)[0] == 1e-3
    old = [{"method": "tt", "target": 8.0, "val": {"loss": 4.0}}]  # before the grid: no lr
    assert at_best_lr(old, lambda r: r["val"]["loss"]) == (old, "-")
    assert set(by_method(rows)) == {(8.0, "tt")}


def test_runs_files_are_written_after_every_model_and_merged(tmp_path):
    first = RunsFile(tmp_path, "a", "benchmarks.studies.x", {"train": 3}, {"seeds": [0]}, [])
    first.add([_row(0, "dense", 1e-3, 4.0, None)])
    assert json.loads((tmp_path / "runs" / "a.json").read_text())["rows"][0]["seed"] == 0
    second = RunsFile(tmp_path, "b", "benchmarks.studies.x", {"train": 3}, {}, ["--tag", "b"])
    second.add([_row(1, "fixed", 1e-3, 4.4)])
    result = merge(tmp_path, "toy", lambda r: r | {"method": r["method"].upper()})
    assert [r["method"] for r in result["rows"]] == ["DENSE", "FIXED"]
    assert [r["command"] for r in result["runs"]] == [
        "python -m benchmarks.studies.x ", "python -m benchmarks.studies.x --tag b"]
    assert result["runs"][0]["machine"]["threads"] >= 1 and result["data"] == {"train": 3}


def test_the_curves_plot_against_step_and_wall_clock(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [_row(s, "tt", 1e-3, 4.0 + s) for s in (0, 1)]
    assert plot_curves({"tt": rows, "empty": []}, tmp_path / "c.png", title="t", metric="loss")
    assert (tmp_path / "c.png").stat().st_size > 1000
    assert not plot_curves({}, tmp_path / "none.png", title="t", metric="loss")
