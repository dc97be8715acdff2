"""The defaults study's tables: each arm's final test metric over seeds, against dense."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.studies import quick_defaults as qd


def _write(work, arm, task, seed, value, compression=8.0):
    out = qd.run_dir(work, arm, task, seed)
    out.mkdir(parents=True)
    metric = qd.TASKS[task]
    rows = [{"name": "early", "test": {metric: 99.0}, "sizes": {"tt_compression": 3.0}},
            {"name": "late", "test": {metric: value}, "sizes": {"tt_compression": compression}}]
    (out / f"{task}.json").write_text(json.dumps({"rows": rows}))


def test_summary_reads_each_runs_last_row_and_compares_with_dense(tmp_path):
    values = {"dense": (10.0, 12.0), "before": (14.0, 16.0), "defaults": (11.0, 11.0),
              "ttm": (9.0, 10.0)}
    for task in qd.TASKS:
        for arm, (a, b) in values.items():
            _write(tmp_path, arm, task, 0, a)
            _write(tmp_path, arm, task, 1, b)
    payload, markdown = qd.summarise(tmp_path, [0, 1])
    rows = {(r["task"], r["arm"]): r for r in payload["rows"]}
    before = rows[("lm", "before")]
    assert before["values"] == [14.0, 16.0]  # the last row, not the early stage's
    assert before["mean"] == 15.0 and math.isclose(before["sd"], math.sqrt(2))
    assert math.isclose(before["vs_dense"], 15.0 / 11.0 - 1)
    assert rows[("mlm", "ttm")]["compressions"] == [8.0, 8.0]
    assert "15.000 ± 1.414" in markdown and "+36.4%" in markdown


def test_a_missing_run_is_named(tmp_path):
    _write(tmp_path, "dense", "lm", 0, 1.0)
    with pytest.raises(SystemExit, match="before-lm-s0"):
        qd.summarise(tmp_path, [0])


@pytest.mark.parametrize("argv", [["--seeds", "0", "0"], ["--seeds", "-1"]])
def test_bad_seeds_exit_2_before_any_run(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        qd.main([*argv, "--work", str(tmp_path / "w")])
    assert exc.value.code == 2 and "--seeds" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_every_comera_arm_names_its_format():
    """Each arm measures what it says whatever `comera train`'s default format is (issue 40)."""
    formats = {arm: flags[flags.index("--format") + 1] for arm, flags in qd.ARMS.items()
               if arm != "dense"}
    assert formats == {"before": "tt", "defaults": "tt", "ttm": "ttm"}
