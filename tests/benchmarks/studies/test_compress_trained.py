"""benchmarks/studies/compress_trained.py: a --smoke run on a tiny corpus pretrains once (cached),
compresses every arm, fine-tunes through the engine and writes the summary and the plot."""

from __future__ import annotations

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
    assert "Targets at 2x" in text and (out / "perplexity.png").is_file()
