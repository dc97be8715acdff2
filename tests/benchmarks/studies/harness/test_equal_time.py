"""benchmarks/studies/harness/equal_time.py: each model's steps from its measured step time,
the budgets read off one constant-rate run, the best rate per budget, the unigram baseline, and
an --equal-time smoke run of the LM frontier."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.studies import lm_frontier
from benchmarks.studies.harness import equal_time
from benchmarks.studies.harness.frontier import label
from comera.experiments.lm_task import LMTask, LMTaskConfig, next_token_targets
from tests.helpers.tiny_corpus import write_tiny_corpus

CLOCK = {"results": {"dense": {"ms": 100.0, "peak_mib": 80.0, "gflops": 12.0},
                     "narrow 8x": {"ms": 40.0, "peak_mib": 50.0, "gflops": 4.0},
                     "tt 8x": {"ms": 60.0, "peak_mib": 60.0, "gflops": 5.0},
                     "ttm 8x": {"ms": 110.0}}}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_stdlib")
    write_tiny_corpus(path)
    return path


def test_each_model_trains_the_steps_its_step_time_buys_in_denses_budget():
    steps = equal_time.steps_from_clock(CLOCK, 800, 8)
    assert steps("dense", None) == 800
    assert steps("narrow", 8.0) == 2000  # 800 x 100 / 40
    assert steps("tt:balanced", 8.0) == 1328  # 1333.3 down to a multiple of 8
    assert steps("ttm", 8.0) == 720  # 727.3 down to a multiple of 8
    assert all(steps(m, 8.0) % 8 == 0 for m in ("narrow", "tt", "ttm"))
    with pytest.raises(ValueError, match="no step time for 'btt'"):
        steps("btt", 8.0)


def _row(method, lr, seed, losses, target=8.0, steps=8):
    """A row evaluated at each quarter of its steps with ``losses`` (4 values)."""
    curves = {"val": [[0, 0.0, {"loss": 9.0}]] + [
        [steps * (k + 1) // 4, None, {"loss": v}] for k, v in enumerate(losses)]}
    row = {"method": method, "target": None if method == "dense" else target, "lr": lr,
           "seed": seed, "steps": steps, "curves": curves}
    return row | {"budget": equal_time.budget_entry(row, CLOCK)}


def test_a_row_holds_its_loss_at_each_fraction_and_its_clock():
    row = _row("tt:balanced", 1e-3, 0, [5.0, 4.0, 3.5, 3.0])
    b = row["budget"]
    assert b["val_at"] == [[0.0, 9.0], [0.25, 5.0], [0.5, 4.0], [0.75, 3.5], [1.0, 3.0]]
    assert b["step_ms"] == 60.0 and b["seconds"] == pytest.approx(8 * 0.06)
    assert (b["peak_mib"], b["gflops_step"]) == (60.0, 5.0)


def test_each_budget_picks_its_own_best_rate():
    # the fast rate leads early, the slow one at the end: each budget has its own best
    rows = [_row("tt", lr, s, losses) for s in (0, 1) for lr, losses in (
        (1e-3, [6.0, 5.0, 4.0, 3.0]), (3e-3, [5.0, 4.0, 3.8, 3.5]), (1e-2, [5.5, 4.5, 4.2, 4.0]))]
    assert equal_time.at_budget(rows, 0.5)[(8.0, "tt")][1] == "0.003 of 0.001..0.01"
    assert equal_time.at_budget(rows, 1.0)[(8.0, "tt")][1] == "0.001 of 0.001..0.01, at the edge"


def test_the_report_compares_each_model_with_dense_and_narrow_at_each_budget():
    rows = [_row("dense", 1e-3, 0, [6.0, 5.0, 4.5, 4.0]),
            _row("narrow", 1e-3, 0, [5.0, 4.4, 4.0, 3.6], steps=16),
            _row("tt", 1e-3, 0, [5.5, 4.8, 4.4, 4.2], steps=8)]
    run = {"command": "python -m benchmarks.studies.lm_frontier --equal-time",
           "machine": {"cpu": "cpu", "threads": 1},
           "settings": {"d_model": 256, "schedule": "constant", "warmup": 100}}
    text = equal_time.summarise({"rows": rows, "runs": [run]}, label, {"val": 7.0, "test": 7.1})
    assert "val loss 7.0000" in text  # the majority-class baseline
    half = text.split("## Budget 0.5")[1].split("## Budget 1")[0]
    tt = next(line for line in half.splitlines() if "TT at" in line)
    assert "| 4 |" in tt  # half of its 8 steps
    assert f"{4.8 / 5.0 - 1:+.2%}" in tt and f"{4.8 / 4.4 - 1:+.2%}" in tt
    assert "| 20 |" in tt  # GFLOPs to half the budget: 4 steps x 5
    full = text.split("## Budget 1 ")[1]
    assert f"{3.6 / 4.0 - 1:+.2%}" in full  # narrow against dense at the full budget


def test_the_unigram_baseline_scores_the_training_frequencies(root):
    task = LMTask(LMTaskConfig(seq_len=16, vocab_size=64, d_model=16, n_heads=2, d_ff=32,
                               n_layers=1, eval_limit=8), root=root, use_cache=False)
    scores = equal_time.unigram_scores(task)
    targets = next_token_targets(task.train.ids)[1]
    counts = torch.bincount(targets[targets >= 0], minlength=task.vocab).double() + 1
    log_p = (counts / counts.sum()).log()
    _, val = next_token_targets(task.eval_rows("val"))
    val = val[val >= 0]
    assert scores["val"] == pytest.approx(float(-log_p[val].mean()), rel=1e-5)
    assert scores["val"] < math.log(task.vocab)  # it knows the frequencies


def test_flags_are_checked_before_any_work(tmp_path):
    clock = tmp_path / "clock.json"
    clock.write_text(json.dumps({"results": {}, "d_model": 999, "batch": 16}))
    for flags in (["--equal-time"], ["--equal-time", "--clock", str(clock), "--methods",
                                     "comera"],
                  ["--equal-time", "--clock", str(clock), "--evals", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            lm_frontier.main([*flags, "--out", str(tmp_path / "o")])
        assert exit_info.value.code == 2
        assert not (tmp_path / "o").exists()


def test_a_clock_of_other_models_exits_2_before_training(root, tmp_path, capsys):
    clock = tmp_path / "clock.json"
    clock.write_text(json.dumps({"results": {}, "d_model": 999, "batch": 16}))
    with pytest.raises(SystemExit) as exit_info:
        lm_frontier.main(["--smoke", "--root", str(root), "--equal-time", "--clock", str(clock),
                          "--methods", "dense", "--seeds", "0", "--out", str(tmp_path / "o"),
                          "--work", str(tmp_path / "w")])
    assert exit_info.value.code == 2
    assert "timed d_model 999" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_an_equal_time_smoke_run_gives_each_model_its_clocks_steps(root, tmp_path):
    task = LMTask(LMTaskConfig(seq_len=16, vocab_size=64, d_model=16, n_heads=2, d_ff=32,
                               n_layers=1, eval_limit=8), root=root, use_cache=False)
    clock = tmp_path / "clock.json"
    clock.write_text(json.dumps({"d_model": task.config.d_model, "batch": 16, "machine": {
        "cpu": "cpu", "threads": 1}, "results": {
        "dense": {"ms": 10.0, "peak_mib": 1.0, "gflops": 0.01},
        "narrow 4x": {"ms": 5.0, "peak_mib": 1.0, "gflops": 0.005},
        "tt 4x": {"ms": 20.0, "peak_mib": 1.0, "gflops": 0.01}}}))
    out = tmp_path / "out"
    assert lm_frontier.main(["--smoke", "--root", str(root), "--equal-time", "--clock",
                             str(clock), "--evals", "2", "--seeds", "0", "--targets", "4",
                             "--methods", "dense", "narrow", "tt", "--out", str(out),
                             "--work", str(tmp_path / "work"), "--early", "2", "--late", "2",
                             "--lrs", "1e-3"]) == 0
    rows = {r["method"]: r for r in json.loads((out / "frontier.json").read_text())["rows"]}
    assert (rows["dense"]["steps"], rows["narrow"]["steps"], rows["tt"]["steps"]) == (4, 8, 2)
    for r in rows.values():
        assert [f for f, _ in r["budget"]["val_at"]] == [0.0, 0.5, 1.0]
        assert r["budget"]["val_at"][-1][1] == pytest.approx(r["val"]["loss"])
    text = (out / "equal_time.md").read_text()
    assert "## Budget 0.5" in text and "## Budget 1 " in text and "Majority-class" in text
    assert (out / "equal_time.png").is_file()


def test_the_time_to_denses_final_loss_is_read_between_evaluations():
    curve = [[0.0, 9.0], [0.5, 4.0], [1.0, 3.0]]
    assert equal_time.time_to(curve, 3.5) == pytest.approx(0.75)
    assert equal_time.time_to(curve, 4.0) == 0.5
    assert equal_time.time_to(curve, 2.0) is None
    rows = [_row("dense", 1e-3, 0, [6.0, 5.0, 4.5, 4.0]),
            _row("narrow", 1e-3, 0, [5.0, 4.4, 4.0, 3.6], steps=16)]
    table = "\n".join(equal_time.reach_table(rows, label))
    assert "dense's final validation loss (4.0000)" in table
    assert "| 8x | narrower dense, same size | 1 | 0.75 |" in table


def test_a_width_or_model_missing_from_the_clock_exits_2_naming_the_lm_clock_command(
        root, tmp_path, capsys):
    clock = tmp_path / "clock.json"
    times = {"dense": {"ms": 100.0}, "dense@8": {"ms": 40.0}}
    clock.write_text(json.dumps({"results": times, "d_model": 16, "batch": 16}))
    common = ["--smoke", "--root", str(root), "--equal-time", "--clock", str(clock),
              "--seeds", "0", "--targets", "2", "--out", str(tmp_path / "o"), "--work",
              str(tmp_path / "w")]
    for flags, says in ((["--methods", "dense", "narrow", "--widths", "8", "4"],
                         "no step time for 'dense@4' (method narrow; it has dense, dense@8): "
                         "time it with python -m benchmarks.studies.lm_clock --d-model 16 "
                         "--batch 16 --widths 8 4"),
                        (["--methods", "dense", "tt"], "no step time for 'tt 2x'")):
        with pytest.raises(SystemExit) as exit_info:
            lm_frontier.main([*common, *flags])
        assert exit_info.value.code == 2 and says in capsys.readouterr().err
        assert not (tmp_path / "o").exists() and not (tmp_path / "w").exists()


def test_widths_train_the_steps_their_clock_buys_and_are_reported(root):
    from benchmarks.studies.harness.frontier import parse, study

    clock = {"results": {"dense": {"ms": 100.0}, "dense@8": {"ms": 40.0, "peak_mib": 9.0}},
             "d_model": 16, "batch": 16}
    args = parse(lm_frontier.SPEC, ["--smoke", "--methods", "dense", "narrow", "--widths", "8",
                                    "--equal-time", "--clock", __file__, "--evals", "2"])
    task = LMTask(LMTaskConfig(seq_len=16, vocab_size=64, d_model=16, n_heads=2, d_ff=32,
                               n_layers=1, eval_limit=8), root=root, use_cache=False)
    plan = study(lm_frontier.SPEC, args, task, clock)
    assert plan.budget_config("dense@8", None, 0, 1e-3).steps_early == 16  # 7 x 100 / 40
    row = {"method": "dense@8", "target": None, "steps": 16,
           "curves": {"val": [[0, 0.0, {"loss": 9.0}], [8, None, {"loss": 5.0}],
                              [16, None, {"loss": 4.0}]]}}
    assert equal_time.budget_entry(row, clock)["step_ms"] == 40.0
    rows = [_row("dense", 1e-3, 0, [6.0, 5.0, 4.5, 4.0]),
            _row("narrow", 1e-3, 0, [5.0, 4.4, 4.0, 3.6], steps=16)]
    width = {"method": "dense@96", "target": None, "lr": 1e-3, "seed": 0, "steps": 16,
             "curves": rows[1]["curves"]}
    rows.append(width | {"budget": equal_time.budget_entry(
        width, {"results": {"dense@96": {"ms": 40.0}}})})
    run = {"command": "python -m benchmarks.studies.lm_frontier --equal-time",
           "machine": {"cpu": "cpu", "threads": 1}, "settings": {}}
    text = equal_time.summarise({"rows": rows, "runs": [run]}, label)
    assert "| - | dense, d_model 96 | 1 | 16 |" in text  # every budget, no target
    assert "| - | dense, d_model 96 | 1 | 0.75 |" in text  # to dense's final loss (4.0)


def test_a_call_of_widths_alone_is_reported_without_dense():
    width = {"method": "dense@96", "target": None, "lr": 1e-3, "seed": 0, "steps": 8,
             "curves": _row("narrow", 1e-3, 0, [5.0, 4.4, 4.0, 3.6])["curves"]}
    width |= {"budget": equal_time.budget_entry(width, {"results": {"dense@96": {"ms": 40.0}}})}
    run = {"command": "python -m benchmarks.studies.lm_frontier --equal-time",
           "machine": {"cpu": "cpu", "threads": 1}, "settings": {}}
    text = equal_time.summarise({"rows": [width], "runs": [run]}, label)
    assert "about 0 s; dense is not in these rows" in text  # 8 steps x 40 ms
    assert "| - | dense, d_model 96 | 1 | 8 | 0.001 | 3.6000 ± nan | - | - | 40 |" in text
