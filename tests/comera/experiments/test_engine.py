"""The training engine: stages, resume (in-process and after a kill), non-finite policies,
results files, and the index stream that makes resumed and data-parallel runs exact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

import comera
from comera.experiments.engine import EngineConfig, sizes_of, train_model
from comera.experiments.results import run_experiment, summary_table
from comera.experiments.task import IndexStream
from tests.helpers import ROOT
from tests.helpers.toy_task import ToyTask

CFG = EngineConfig(steps_early=12, steps_late=8, batch_size=16, lr=1e-2, lr_gates=0.1, lam=5.0,
                   target_compression=3.0, eval_every=5)


pytestmark = pytest.mark.usefixtures("one_thread")


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_identical(a, b) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


# -- index stream -------------------------------------------------------------------------------
def test_index_stream_covers_each_epoch_once_and_shards_partition_the_batch():
    stream = IndexStream(size=10, batch_size=4, seed=3)
    seen = torch.cat([stream.indices(s) for s in range(5)])  # 20 indices = 2 epochs
    assert sorted(seen[:10].tolist()) == list(range(10))
    assert sorted(seen[10:].tolist()) == list(range(10))
    for step in range(5):
        halves = torch.cat([stream.shard(step, r, 2) for r in range(2)])
        assert torch.equal(halves, stream.indices(step))
    with pytest.raises(comera.ConfigError, match="multiple of the worker count"):
        stream.shard(0, 0, 3)
    with pytest.raises(comera.ConfigError, match="empty"):
        IndexStream(0, 4)


# -- stages and records -------------------------------------------------------------------------
def test_tt_run_has_both_stages_and_truncates_at_the_boundary(tmp_path):
    model, record = train_model(ToyTask(), "comera", True, CFG, tmp_path)
    assert set(record.stage_ends) == {"early", "late"}
    assert record.steps == CFG.total_steps
    assert len(record.step_times) == CFG.total_steps
    late_sizes = record.stage_ends["late"]["sizes"]
    early_sizes = record.stage_ends["early"]["sizes"]
    assert late_sizes["tt_params"] <= early_sizes["tt_params"]
    assert sizes_of(model)["tt_compression"] == pytest.approx(
        comera.compression_ratio(model, only=comera.GatedTrain))
    assert record.val_curve[0][0] == 0 and record.val_curve[-1][0] == CFG.total_steps


def test_the_late_stage_starts_with_the_pruned_ranks_removed(tmp_path):
    model, _ = train_model(ToyTask(), "comera", True, CFG, tmp_path,
                           stop_after=CFG.steps_early)  # returns right after the boundary
    layer = model[0]
    assert layer.ranks != (1, 4, 6, 4, 1), "lam=5 should have pruned some rank"
    assert layer.bonds == layer.ranks  # stored shapes shrank to the effective ranks


def test_late_stage_shrinks_toward_the_target_while_the_loss_is_near_its_early_level(tmp_path):
    cfg = replace(CFG, lam=0.5, steps_late=30)
    _, record = train_model(ToyTask(), "comera", True, cfg, tmp_path)
    early = record.stage_ends["early"]["sizes"]["tt_params"]
    late = record.stage_ends["late"]["sizes"]["tt_params"]
    assert late < early  # the late stage pruned further toward 1/3 of the dense size
    choices = {w for step, _, _, w in record.train_curve if step >= cfg.steps_early}
    assert "size" in choices


def test_dense_run_is_one_stage_and_learns(tmp_path):
    cfg = replace(CFG, steps_early=30, steps_late=10)
    _, record = train_model(ToyTask(), "dense", False, cfg, tmp_path)
    assert list(record.stage_ends) == ["dense"]
    assert record.val_curve[-1][1]["loss"] < 0.5 * record.val_curve[0][1]["loss"]


def test_run_experiment_writes_table_json_and_plots(tmp_path):
    summary = run_experiment(ToyTask(), CFG, tmp_path)
    names = [row["name"] for row in summary["rows"]]
    assert names == ["dense", "comera (early)", "comera (late)"]
    saved = json.loads((tmp_path / "toy.json").read_text())
    assert saved["rows"][0]["speedup"] == pytest.approx(1.0)
    table = (tmp_path / "toy.md").read_text()
    assert table.strip() == summary_table(summary)
    late = summary["rows"][2]
    assert f"{late['sizes']['tt_compression']:.1f}x" in table
    for png in ("toy_curves.png", "toy_ranks.png", "toy_tradeoff.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


# -- resume -------------------------------------------------------------------------------------
@pytest.mark.parametrize("stop_at", [7, 12, 15])  # early stage, at the boundary, late stage
def test_resumed_run_ends_bit_identical_to_an_uninterrupted_one(tmp_path, stop_at):
    task = ToyTask(dropout=0.2)  # dropout: the RNG state must be restored too
    whole, rec_whole = train_model(task, "comera", True, CFG, tmp_path / "a")
    train_model(task, "comera", True, CFG, tmp_path / "b", stop_after=stop_at)
    resumed, rec_resumed = train_model(task, "comera", True, CFG, tmp_path / "b", resume=True)
    _assert_identical(_params(whole), _params(resumed))
    assert rec_whole.train_curve == rec_resumed.train_curve
    assert rec_whole.ranks == rec_resumed.ranks


def test_resume_refuses_other_settings_and_foreign_checkpoints(tmp_path):
    train_model(ToyTask(), "comera", True, CFG, tmp_path, stop_after=3)
    with pytest.raises(comera.CheckpointError, match="lr"):
        train_model(ToyTask(), "comera", True, replace(CFG, lr=0.5), tmp_path, resume=True)
    path = tmp_path / "checkpoints" / "comera.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(comera.CheckpointError):
        train_model(ToyTask(), "comera", True, CFG, tmp_path, resume=True)


_KILL_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
sys.path[:0] = [{root!r}]
from pathlib import Path
from tests.helpers.toy_task import ToyTask
from comera.experiments.engine import EngineConfig, train_model
cfg = EngineConfig(**{cfg!r})
train_model(ToyTask(delay={delay}), "comera", True, cfg, Path({out!r}))
"""


def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path):
    cfg = replace(CFG, steps_early=20, steps_late=20, checkpoint_every=4)
    from dataclasses import asdict

    script = _KILL_SCRIPT.format(root=str(ROOT), cfg=asdict(cfg),
                                 delay=0.05, out=str(tmp_path / "killed"))
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ,
                            "PYTHONPATH": str(ROOT)})
    ckpt = tmp_path / "killed" / "checkpoints" / "comera.pt"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if ckpt.is_file():
            extra = torch.load(ckpt, weights_only=True)["extra"]["engine"]
            if extra["step"] >= 8:
                break
        time.sleep(0.05)
    assert proc.poll() is None, "the training process ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    step_at_kill = torch.load(ckpt, weights_only=True)["extra"]["engine"]["step"]
    assert 8 <= step_at_kill < cfg.total_steps
    resumed, _ = train_model(ToyTask(), "comera", True, cfg, tmp_path / "killed", resume=True)
    whole, _ = train_model(ToyTask(), "comera", True, cfg, tmp_path / "whole")
    _assert_identical(_params(whole), _params(resumed))


# -- faults -------------------------------------------------------------------------------------
def test_nonfinite_loss_stops_and_names_the_last_good_checkpoint(tmp_path):
    stream = IndexStream(256, CFG.batch_size, CFG.seed)
    poisoned = int(stream.indices(9)[0])  # first seen at step 9
    task = ToyTask(poison=(poisoned,))
    cfg = replace(CFG, checkpoint_every=4)
    with pytest.raises(comera.TrainingStopped, match=r"comera\.pt") as info:
        train_model(task, "comera", True, cfg, tmp_path)
    assert "step 9" in str(info.value)
    saved = torch.load(tmp_path / "checkpoints" / "comera.pt", weights_only=True)
    assert saved["extra"]["engine"]["step"] == 8
    assert all(torch.isfinite(v).all() for v in saved["model"].values())


def test_nonfinite_loss_skip_policy_drops_the_batch_and_keeps_the_model_finite(tmp_path):
    stream = IndexStream(256, CFG.batch_size, CFG.seed)
    poisoned = int(stream.indices(3)[0])
    cfg = replace(CFG, on_nonfinite="skip")
    model, record = train_model(ToyTask(poison=(poisoned,)), "dense", False, cfg, tmp_path)
    assert record.skipped >= 1
    assert len(record.step_times) == cfg.total_steps - record.skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_nonfinite_gradient_is_refused_before_the_optimizer_step():
    model = torch.nn.Linear(3, 1, dtype=torch.float64)
    trainer = comera.DenseTrainer(model)
    before = _params(model)
    loss = torch.sqrt((model.weight * 0).sum())  # a finite loss (0) whose gradient is inf
    with pytest.raises(comera.NonFiniteGradientError, match="weight"):
        trainer.step(loss)
    _assert_identical(before, _params(model))
    assert all(p.grad is None for p in model.parameters())


def test_engine_config_rejects_bad_values():
    with pytest.raises(comera.ConfigError, match="stage"):
        EngineConfig(stage="middle")
    with pytest.raises(comera.ConfigError, match="on_nonfinite"):
        EngineConfig(on_nonfinite="ignore")
    with pytest.raises(comera.ConfigError, match="target_compression"):
        EngineConfig(target_compression=1.0)
    with pytest.raises(comera.ConfigError, match="batch_size"):
        EngineConfig(batch_size=0)
