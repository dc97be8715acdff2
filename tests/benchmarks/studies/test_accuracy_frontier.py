"""The reviews frontier's pieces that need no training: rows of before read under their names,
the table (mean ± sd per method and target, the ranks chosen next to the uniform ones), the
plot, and its flags checked before any work."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.studies.accuracy_frontier import main, plot, summarise, upgrade


def test_rows_of_before_are_read_under_their_own_names():
    warm = {"model": "comera", "restart": False}
    assert upgrade(warm)["model"] == "comera-warm"
    assert upgrade({"model": "lowrank"})["model"] == "lowrank-ungated"  # LowRankLinear rows
    assert upgrade({"model": "lowrank", "format": "lowrank"})["model"] == "lowrank"
    assert upgrade({"model": "comera", "restart": True})["model"] == "comera"


def _result():
    rows = []
    for seed, shift in ((0, 0.0), (1, 0.01), (2, 0.02)):
        rows.append({"seed": seed, "model": "dense", "target": None,
                     "test": {"accuracy": 0.85 + shift}})
        for target in (10.0, 100.0):
            rows.append({"seed": seed, "model": "fixed", "target": target, "rank": 4,
                         "test": {"accuracy": 0.84 + shift}, "linear_compression": target * 1.1,
                         "ranks": {"blocks.0.q": [1, 4, 4, 1]}})
            rows.append({"seed": seed, "model": "comera", "target": target, "uniform_rank": 4,
                         "test": {"accuracy": 0.86 + shift}, "linear_compression": target,
                         "ranks": {"blocks.0.attn.q": [1, 4, 6, 1]}})
        rows.append({"seed": seed, "model": "lowrank", "target": 10.0, "rank": 8,
                     "test": {"accuracy": 0.83 + shift}, "linear_compression": 10.5,
                     "ranks": {"blocks.0.q": [8]}})
    return {"data": {"train": 10, "val": 2, "test": 2, "majority_test": 0.8}, "rows": rows}


def test_summary_gives_mean_and_spread_per_method_and_the_ranks_chosen():
    text = summarise(_result())
    sd = statistics.stdev([0.0, 0.01, 0.02])
    assert f"Dense: 0.8600 ± {sd:.4f} (n=3)" in text
    lines = {line.split(" |")[0]: line for line in text.splitlines() if line.startswith("| 1")}
    assert lines["| 10x"] == (f"| 10x | 0.8500 ± {sd:.4f} (n=3; 11.0x, rank 4) | 0.8400 ± "
                              f"{sd:.4f} (n=3; 10.5x, rank 8) | 0.8700 ± {sd:.4f} (n=3; 10.0x) |")
    assert lines["| 100x"].split(" | ")[2] == "-"  # no low-rank row, no plan saying why
    planned = _result() | {"plan": {"lowrank": {"10.0": 8, "100.0": 0}}}
    lines = {line.split(" |")[0]: line for line in summarise(planned).splitlines()
             if line.startswith("| 1")}
    assert lines["| 100x"].split(" | ")[2] == "none fits: rank 1 is over the budget"
    assert "- 100x (uniform rank 4): b0.q [4, 6]" in text
    assert "- 10x: 0.0200 ± 0.0000 (n=3; seeds +0.0200, +0.0200, +0.0200)" in text  # paired


def test_summarise_only_writes_table_and_plot(tmp_path):
    import json

    (tmp_path / "frontier.json").write_text(json.dumps(_result()))
    assert main(["--summarise-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "frontier.md").read_text().startswith("Reviews task")
    assert (tmp_path / "frontier.png").stat().st_size > 1000
    plot(_result(), tmp_path / "again.png")


@pytest.mark.parametrize("flags", [["--early-landing", "0"], ["--early-landing", "1.5"],
                                   ["--threads", "0"], ["--eval-every", "0"],
                                   ["--early", "500"], ["--summarise-only"]])
def test_bad_flags_exit_2_before_any_training(flags, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main([*flags, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert not (tmp_path / "out").exists()


def test_the_balanced_fixed_rank_has_its_own_column_and_plot_series(tmp_path):
    result = _result()
    for seed, shift in ((0, 0.0), (1, 0.01), (2, 0.02)):
        result["rows"].append({"seed": seed, "model": "fixed-balanced", "target": 10.0,
                               "rank": 4, "test": {"accuracy": 0.80 + shift},
                               "linear_compression": 11.0, "ranks": {"blocks.0.q": [1, 4, 4, 1]}})
    text = summarise(result)
    header = next(line for line in text.splitlines() if line.startswith("| target"))
    assert header.split(" | ")[1:3] == ["fixed uniform TT rank",
                                        "fixed uniform TT rank, balanced cores"]
    row = next(line for line in text.splitlines() if line.startswith("| 10x"))
    sd = statistics.stdev([0.0, 0.01, 0.02])
    assert row.split(" | ")[2] == f"0.8100 ± {sd:.4f} (n=3; 11.0x, rank 4)"
    plot(result, tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 0
