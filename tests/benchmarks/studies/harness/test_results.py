"""A study's results: runs files merged, the learning rate chosen on validation per method
from one grid (the edge said), the curves plot, and the committed summary without curves."""

from __future__ import annotations

import json

import pytest

from benchmarks.studies.harness.results import (
    CURVES,
    RunsFile,
    at_best_lr,
    best_lrs,
    by_method,
    curves_path,
    merge,
    plot_curves,
    read_summary,
    without_curves,
    write_summary,
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
    runs = tmp_path / CURVES / "runs"  # the git-ignored folder: rows with their curves
    assert json.loads((runs / "a.json").read_text())["rows"][0]["curves"]
    second = RunsFile(tmp_path, "b", "benchmarks.studies.x", {"train": 3}, {}, ["--tag", "b"])
    second.add([_row(1, "fixed", 1e-3, 4.4)])
    result = merge(tmp_path, "toy", lambda r: r | {"method": r["method"].upper()})
    assert [r["method"] for r in result["rows"]] == ["DENSE", "FIXED"]
    assert [r["tag"] for r in result["rows"]] == ["a", "b"]
    assert [r["command"] for r in result["runs"]] == [
        "python -m benchmarks.studies.x ", "python -m benchmarks.studies.x --tag b"]
    assert result["runs"][0]["machine"]["threads"] >= 1 and result["data"] == {"train": 3}


def test_the_curves_plot_against_step_and_wall_clock(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [_row(s, "tt", 1e-3, 4.0 + s) for s in (0, 1)]
    assert plot_curves({"tt": rows, "empty": []}, tmp_path / "c.png", title="t", metric="loss")
    assert (tmp_path / "c.png").stat().st_size > 1000
    assert not plot_curves({}, tmp_path / "none.png", title="t", metric="loss")


def test_rates_are_compared_on_the_seeds_they_share():
    # the grid on seed 0, then seeds 1 and 2 at the rate seed 0 chose: a worse seed 1 or 2
    # must not hand the choice to a rate that only ran on seed 0
    rows = [_row(0, "tt", 1e-3, 3.740), _row(1, "tt", 1e-3, 3.776), _row(2, "tt", 1e-3, 3.767),
            _row(0, "tt", 3e-3, 3.741), _row(0, "tt", 1e-2, 5.1), _row(0, "tt", 3e-4, 4.0)]
    chosen, how = at_best_lr(rows, lambda r: r["val"]["loss"])
    assert {r["lr"] for r in chosen} == {1e-3} and len(chosen) == 3
    assert how == "0.001 of 0.0003..0.01"
    # two rates on three seeds each are compared on all three, not on seed 0 alone
    rows = [_row(s, "ttm", 3e-3, v) for s, v in ((0, 3.371), (1, 3.34), (2, 3.34))]
    rows += [_row(s, "ttm", 1e-2, v) for s, v in ((0, 3.366), (1, 3.40), (2, 3.39))]
    rows += [_row(0, "ttm", 1e-3, 3.48), _row(0, "ttm", 3e-2, 5.0)]
    assert best_lrs(rows, lambda r: r["val"]["loss"])[0] == 3e-3
    assert best_lrs(rows, lambda r: r["val"]["loss"], lower=False)[0] == 3e-2


def test_the_summary_drops_every_curve_and_the_curves_folder_keeps_them(tmp_path):
    payload = {"task": "t", "rows": [_row(0, "tt", 1e-3, 4.0)],
               "parts": {"x": {"rows": [{"curves": [1, 2]}]}}}  # at any depth
    path = write_summary(tmp_path / "study.json", payload)
    text = path.read_text()
    assert '"curves"' not in text and '"val"' in text
    assert json.loads(curves_path(path).read_text()) == payload
    assert read_summary(path) == payload  # written together: the curves join back
    write_summary(path, payload | {"task": "changed"}, curves=False)  # the copy is now stale
    assert read_summary(path) == without_curves(payload | {"task": "changed"})
    plain = write_summary(tmp_path / "plain.json", {"rows": [{"val": 1}]})
    assert not curves_path(plain).exists()  # nothing to keep: no copy


def test_a_fresh_checkout_merges_the_committed_rows_and_a_run_here_replaces_its_tag(tmp_path):
    first = RunsFile(tmp_path, "a", "benchmarks.studies.x", {"train": 3}, {}, [])
    first.add([_row(0, "tt", 1e-3, 4.0)])
    RunsFile(tmp_path, "b", "benchmarks.studies.x", {"train": 3}, {}, []).add(
        [_row(1, "tt", 1e-3, 4.5)])
    write_summary(tmp_path / "frontier.json", merge(tmp_path, "toy"), curves=False)
    for path in (tmp_path / CURVES / "runs").glob("*.json"):
        path.unlink()  # a fresh checkout: the summary alone
    fresh = merge(tmp_path, "toy")
    assert [(r["tag"], r["seed"], r["val"]) for r in fresh["rows"]] == [
        ("a", 0, {"loss": 4.0}), ("b", 1, {"loss": 4.5})]
    assert all(r["curves"] is None for r in fresh["rows"])  # made, but not here
    RunsFile(tmp_path, "b", "benchmarks.studies.x", {"train": 3}, {}, []).add(
        [_row(2, "tt", 1e-3, 3.0)])  # tag b again, here
    again = merge(tmp_path, "toy")
    assert [(r["tag"], r["seed"]) for r in again["rows"]] == [("a", 0), ("b", 2)]
    assert again["rows"][1]["curves"]["val"]


def test_the_curves_plot_keeps_the_committed_file_when_curves_are_not_here(tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "c.png"
    plot.write_bytes(b"committed")
    here = [_row(0, "tt", 1e-3, 4.0)]
    elsewhere = [_row(1, "tt", 1e-3, 4.0) | {"curves": None}]
    assert not plot_curves({"tt": here + elsewhere}, plot, title="t", metric="loss")
    assert plot.read_bytes() == b"committed"
    older = [{k: v for k, v in _row(1, "tt", 1e-3, 4.0).items() if k != "curves"}]
    assert plot_curves({"tt": here + older}, plot, title="t", metric="loss")  # before curves
