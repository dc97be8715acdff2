"""benchmarks/studies/compress_trained.py: a --smoke run on a tiny corpus pretrains once (cached),
compresses every arm, fine-tunes through the engine and writes the summary and the plot."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from benchmarks.studies import compress_trained as study
from tests.helpers.tiny_corpus import write_tiny_corpus


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_stdlib")
    write_tiny_corpus(path)
    return path


def test_calibration_rows_depend_on_the_seed_only(root):
    task = study.make_task("lm", smoke=True, root=root)
    a, b = study.calibration_rows(task, 0, 8), study.calibration_rows(task, 0, 8)
    assert torch.equal(a, b) and not torch.equal(a, study.calibration_rows(task, 1, 8))
    batches = study.calibration_batches(task, a)
    assert batches[0].shape == (8, task.config.seq_len - 1)  # the LM reads all but the last


def test_the_mlm_sensitivity_arm_measures_the_masked_token_loss(root):
    task = study.make_task("mlm", smoke=True, root=root)
    torch.manual_seed(0)
    dense = task.build_model("dense").eval()
    chosen = study.calibration_rows(task, 0, 40)
    labelled = study.labelled_batches(task, chosen)
    inputs = study.calibration_batches(task, chosen)
    assert [b[0].shape[0] for b in labelled] == [32, 8]
    for (x, _), y in zip(labelled, inputs, strict=True):  # the other arms' inputs, unchanged
        assert torch.equal(x, y)
    with torch.no_grad():  # the wrapper's output is the task's own loss on that batch
        assert float(study.MaskedLMLoss(dense)(*labelled[0])) == pytest.approx(
            float(task.loss(dense, labelled[0])), rel=1e-6)
    base, _ = study.convert_arm(dense, "lowrank", "uniform/plain", 2, None, None)
    model, report = study.convert_arm(dense, "lowrank", "sensitivity/calibrated", 2,
                                      study.core_params(base), labelled)
    names = {n for n, _ in study.comera.gated_layers(model)}
    assert names and all(n.startswith("blocks.") for n in names)  # the MLM's, not the wrapper's
    losses = dict(report.losses)  # measured on the labelled batches, through the wrapper
    assert report.measured_batches == 2 and {"dense", "uniform", "sensitivity"} <= set(losses)
    with torch.no_grad():
        own = sum(float(task.loss(dense, b)) for b in labelled) / len(labelled)
    assert losses["dense"] == pytest.approx(own, rel=1e-5)
    assert study.core_params(model) <= study.core_params(base)
    assert all(p.requires_grad for p in dense.parameters()) and not list(
        study.comera.gated_layers(dense))  # the dense model is left as it was


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lm", "mlm"])
def test_smoke_run_writes_every_arm(root, tmp_path, name):
    common = ["--task", name, "--smoke", "--root", str(root), "--steps", "6",
              "--cache", str(tmp_path / "cache"), "--eval-every", "3"]
    assert study.main(["pretrain", *common]) == 0
    cached = list((tmp_path / "cache").glob("*.pt"))
    assert len(cached) == 1
    out = tmp_path / "out"
    argv = ["compress", *common, "--formats", "tt", "lowrank", "--targets", "2", "--seeds", "0",
            "1", "--calib-rows", "16", "--finetune", "2", "--gate-steps", "2", "--out", str(out),
            "--tag", "smoke"]
    assert study.main(argv) == 0
    result = json.loads((out / "runs" / "smoke.json").read_text())
    assert result["command"].startswith("python -m benchmarks.studies.compress_trained")
    arms = {(r["format"], r["arm"]) for r in result["rows"]}
    assert arms == {(f, a) for f in ("tt", "lowrank") for a in study.ARMS}
    for row in result["rows"]:
        assert row["before"]["perplexity"] > 1 and row["after"]["perplexity"] > 1
        assert row["compression"] > 1
    uniform = {r["format"]: r["params"] for r in result["rows"] if r["arm"] == "uniform/plain"}
    for row in result["rows"]:  # the global arms spend at most what the uniform arm holds
        assert row["params"] <= uniform[row["format"]] * 1.02
    assert list((tmp_path / "cache").glob("*.pt")) == cached  # the pretrained model is reused
    assert study.main(["starts", *common, "--formats", "tt", "lowrank", "--calib-rows", "16",
                       "--out", str(out)]) == 0
    table = (out / f"starts_{name}.md").read_text()
    assert "| tt |" in table and "| lowrank |" in table
    assert study.main(["report", "--out", str(out)]) == 0
    text = (out / "summary.md").read_text()
    assert "uniform/plain" in text and "global/calibrated" in text
    assert "Targets (against uniform/plain" in text and (out / "perplexity.png").is_file()


@pytest.mark.slow
def test_grid_then_at_best_fine_tunes_each_arm_at_its_best_cell(root, tmp_path):
    common = ["--task", "lm", "--smoke", "--root", str(root), "--steps", "6",
              "--cache", str(tmp_path / "cache"), "--eval-every", "3"]
    out = tmp_path / "out"
    run = ["compress", *common, "--formats", "lowrank", "--targets", "2", "--calib-rows", "16",
           "--finetune", "2", "--arms", "uniform/plain", "sensitivity/calibrated",
           "--out", str(out)]
    with pytest.raises(SystemExit, match="screen the grid first"):
        study.main([*run, "--seeds", "1", "--at-best", "--tag", "early"])
    assert study.main([*run, "--seeds", "0", "--ft-lrs", "1e-4", "1e-2", "--parametrizations",
                       "plain", "balanced", "--tag", "grid"]) == 0
    grid = json.loads((out / "runs" / "grid.json").read_text())["rows"]
    assert sorted((r["arm"], r["parametrization"], r["ft_lr"]) for r in grid) == sorted(
        (a, p, lr) for a in ("uniform/plain", "sensitivity/calibrated")
        for p in ("plain", "balanced") for lr in (1e-4, 1e-2))
    for arm in ("uniform/plain", "sensitivity/calibrated"):  # one conversion per parametrization
        befores = {r["parametrization"]: r["before"]["perplexity"] for r in grid
                   if r["arm"] == arm}
        assert befores["plain"] == pytest.approx(befores["balanced"], rel=1e-4)
    best = {}
    for arm in ("uniform/plain", "sensitivity/calibrated"):
        rows = [r for r in grid if r["arm"] == arm]
        low = min(rows, key=lambda r: r["after"]["perplexity"])
        best[arm] = (low["parametrization"], low["ft_lr"])
    assert study.main([*run, "--seeds", "1", "--at-best", "--tag", "best"]) == 0
    again = json.loads((out / "runs" / "best.json").read_text())["rows"]
    assert {r["arm"]: (r["parametrization"], r["ft_lr"]) for r in again} == best
    assert [r["seed"] for r in again] == [1, 1]
    assert study.main(["report", "--out", str(out)]) == 0
    text = (out / "summary.md").read_text()
    assert "Fine-tune grid, lm lowrank 2x" in text and "**" in text
    assert "- lm lowrank 2x sensitivity/calibrated: before fine-tuning" in text


@pytest.mark.slow
def test_the_controls_are_the_dense_model_fine_tuned_and_a_narrower_one_from_scratch(root,
                                                                                    tmp_path):
    common = ["--task", "lm", "--smoke", "--root", str(root), "--steps", "6",
              "--cache", str(tmp_path / "cache"), "--eval-every", "3"]
    assert study.main(["pretrain", *common]) == 0
    out = tmp_path / "out"
    assert study.main(["compress", *common, "--formats", "lowrank", "--targets", "4",
                       "--seeds", "0", "--finetune", "2", "--ft-lrs", "1e-3", "--arms",
                       "dense", "narrow", "uniform/plain", "--out", str(out),
                       "--tag", "controls"]) == 0
    result = json.loads((out / "runs" / "controls.json").read_text())
    rows = {r["arm"]: r for r in result["rows"]}
    assert rows["dense"]["before"] == result["dense"]  # not converted: the pretrained model
    assert rows["dense"]["compression"] == 1 and rows["dense"]["after"] != result["dense"]
    task = study.make_task("lm", smoke=True, root=root)
    dense, _ = study.pretrained(study.Pretrain("lm", 6, eval_every=3, smoke=True),
                                tmp_path / "cache", root, train=False)
    base, _ = study.convert_arm(dense, "lowrank", "uniform/plain", 4, None, None)
    size = study.comera.model_size(base)
    narrow = rows["narrow"]
    count = lambda d: sum(p.numel() for p in task.build(  # noqa: E731
        "dense", d_model=d, d_ff=d * task.config.d_ff // task.config.d_model).parameters())
    assert narrow["params"] == count(narrow["d_model"]) <= size  # the widest that fits
    assert narrow["d_model"] == task.config.d_model or count(
        narrow["d_model"] + task.config.n_heads) > size
    assert narrow["after"]["perplexity"] < narrow["before"]["perplexity"]  # trained
    assert study.main(["report", "--out", str(out)]) == 0
    line = next(x for x in (out / "summary.md").read_text().splitlines()
                if x.startswith("| lowrank | 4x | narrow |"))
    # its size is the whole model's, and it has no converted start to compare
    assert f"| {narrow['params']:,} parameters, whole model (d_model {narrow['d_model']}) | " \
        "from scratch | - |" in line


def test_compress_refuses_what_cannot_run_before_converting(tmp_path):
    base = ["compress", "--task", "mlm", "--cache", str(tmp_path), "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="pass --finetune N"):
        study.main([*base, "--ft-lrs", "1e-3"])
    with pytest.raises(SystemExit, match="a control is trained"):
        study.main([*base, "--arms", "narrow"])
    with pytest.raises(SystemExit, match="leave --ft-lrs"):
        study.main([*base, "--finetune", "2", "--at-best", "--ft-lrs", "1e-3"])
    assert not list(tmp_path.iterdir())  # nothing trained or written


def _run(tag, rows, settings):
    dense = {"loss": 3.0, "perplexity": 20.0}
    pretrain = {"spec": {"steps": 10, "batch": 2, "lr": 1e-3}, "seconds": 1.0,
                "val_curve": [[10, {"loss": 3.0}]]}
    return {"tag": tag, "task": "lm", "data": {}, "pretrain": pretrain, "dense": dense,
            "machine": {"cpu": "x", "torch": "t", "threads": 1}, "command": f"cmd {tag}",
            "settings": settings, "rows": rows}


def _row(arm, seed, before, after=None, **extra):
    row = {"format": "tt", "target": 2.0, "arm": arm, "seed": seed, "compression": 2.0,
           "before": {"perplexity": before}, **extra}
    if after is not None:
        row.update(after={"perplexity": after}, finetune=200)
    return row


def test_report_holds_every_arm_at_its_best_cell_and_reads_older_rows(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    old = [_row("uniform/plain", s, 268.0, 40.0 + s) for s in (0, 1, 2)]  # balanced, 3e-4
    old += [_row("global/calibrated", s, 55.0, 32.0 + s) for s in (0, 1, 2)]
    (runs / "a-old.json").write_text(json.dumps(_run("old", old, {"ft_lr": 3e-4})))
    new = [_row("uniform/plain", s, 268.0, 33.9 + s / 10, parametrization="plain", ft_lr=1e-3)
           for s in (0, 1, 2)]
    new += [_row("global/calibrated", 0, 55.0, 31.0, parametrization="balanced", ft_lr=1e-3)]
    (runs / "b-new.json").write_text(json.dumps(_run("new", new, {})))
    result = study.merge(tmp_path)
    cells = {(r["arm"], r["parametrization"], r["ft_lr"]) for r in result["rows"]}
    assert ("uniform/plain", "balanced", 3e-4) in cells  # the older runs' settings
    text = study.summarise(result)
    # uniform/plain at its best (plain, 1e-3: 34.00), not its worst (balanced, 3e-4: 41.00)
    assert "| 34.00 ± 0.10 | plain, 0.001 | +0.0% |" in text
    # global/calibrated's best judged on seed 0, the seed both of its cells hold
    assert "| 31.00 ± 0.00 | balanced, 0.001 | -8.8% |" in text
    assert "Fine-tune grid, lm tt 2x" in text and "| 0.001 (1x, edge) |" in text
    # global/calibrated's best cell holds one seed: no spread, so the target is not judged
    assert ("after fine-tuning 31.00 ± 0.00 vs 34.00 ± 0.10 (gap 3.00, 8.8%; spread 0.10: "
            "not judged: one seed, no spread)") in text
    old_only = [r for r in result["rows"] if r["arm"] != "global/calibrated"
                or r.get("ft_lr") == 3e-4]
    text = study.summarise({**result, "rows": old_only})
    assert "| balanced, 0.0003 (the only cell measured) | -2.9% |" in text
    assert "(gap 1.00, 2.9%; spread 1.00: not met)" in text


def test_the_summary_json_leaves_the_per_layer_fields_in_the_runs_files(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    rows = [_row("uniform/plain", s, 268.0, 34.0 + s, ranks={"blocks.0.q": [1, 4, 4, 1]},
                 errors={"blocks.0.q": 0.5}) for s in (0, 1)]
    (runs / "a.json").write_text(json.dumps(_run("a", rows, {"ft_lr": 1e-3})))
    assert study.cmd_report(argparse.Namespace(out=tmp_path)) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["after"]["perplexity"] for r in summary["rows"]] == [34.0, 35.0]
    assert not any({"ranks", "errors"} & set(r) for r in summary["rows"])
    assert json.loads((runs / "a.json").read_text())["rows"][0]["ranks"]  # still there


@pytest.mark.parametrize("argv, said", [
    (["compress", "--formats", "ttm", "bogus"], "--formats: invalid choice: 'bogus'"),
    (["compress", "--targets", "2", "inf"], "--targets: 'inf': a target is a compression ratio"),
    (["compress", "--targets", "x"], "--targets: 'x': a target is a compression ratio"),
])
def test_a_format_or_target_convert_cannot_take_is_refused_before_any_work(argv, said, tmp_path,
                                                                         capsys):
    with pytest.raises(SystemExit) as exit_:
        study.main([*argv, "--task", "lm", "--out", str(tmp_path), "--cache", str(tmp_path)])
    assert exit_.value.code == 2 and said in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
