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
from comera.experiments.engine import EngineConfig, check_settings, sizes_of, train_model
from comera.experiments.results import run_experiment, summary_table
from comera.experiments.rundir import LOCK_NAME, hold_run_directory
from comera.experiments.task import IndexStream
from tests.helpers import ROOT
from tests.helpers.toy_task import ToyTask

CFG = EngineConfig(steps_early=12, steps_late=8, batch_size=16, lr=1e-2, lr_gates=0.1, lam=20.0,
                   target_compression=3.0, eval_every=5, late_allocation="prune")


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
@pytest.mark.parametrize("fmt", ["tucker", "lowrank"])
def test_the_engine_trains_any_format_the_config_names(tmp_path, fmt):
    """The layer kind goes from EngineConfig.format through Task.build_model to the layers; the
    late stage lands on the target against the format's dense size; a resume with another
    format is refused."""
    cfg = replace(CFG, format=fmt, target_compression=2.0)
    model, record = train_model(ToyTask(), "comera", cfg, tmp_path)
    (_, layer), = comera.gated_layers(model)
    assert layer.format.name == fmt and not isinstance(layer, comera.TTLinear)
    assert record.sizes["linear_compression"] >= 2.0 * 0.95
    assert record.sizes["linear_compression"] == record.sizes["tt_compression"]
    with pytest.raises(comera.CheckpointError, match="format"):
        train_model(ToyTask(), "comera", replace(cfg, format="tt"), tmp_path, resume=True)


def test_tt_run_has_both_stages_and_truncates_at_the_boundary(tmp_path):
    model, record = train_model(ToyTask(), "comera", CFG, tmp_path)
    assert set(record.stage_ends) == {"early", "late"}
    assert record.steps == CFG.total_steps
    assert len(record.step_times) == CFG.total_steps
    late_sizes = record.stage_ends["late"]["sizes"]
    early_sizes = record.stage_ends["early"]["sizes"]
    assert late_sizes["tt_params"] <= early_sizes["tt_params"]
    assert sizes_of(model)["tt_compression"] == pytest.approx(
        comera.compression_ratio(model, only=comera.GatedLayer))
    assert record.val_curve[0][0] == 0 and record.val_curve[-1][0] == CFG.total_steps


def test_the_late_stage_starts_with_the_pruned_ranks_removed(tmp_path):
    model, _ = train_model(ToyTask(), "comera", CFG, tmp_path,
                           stop_after=CFG.steps_early)  # returns right after the boundary
    layer = model[0]
    assert layer.ranks != (1, 4, 6, 4, 1), "lam=20 should have pruned some rank"
    assert layer.bonds == layer.ranks  # stored shapes shrank to the effective ranks


def test_late_stage_shrinks_toward_the_target_while_the_loss_is_near_its_early_level(tmp_path):
    cfg = replace(CFG, lam=0.5, steps_late=30)
    _, record = train_model(ToyTask(), "comera", cfg, tmp_path)
    early = record.stage_ends["early"]["sizes"]["tt_params"]
    late = record.stage_ends["late"]["sizes"]["tt_params"]
    assert late < early  # the late stage pruned further toward 1/3 of the dense size
    choices = {w for step, _, _, w in record.train_curve if step >= cfg.steps_early}
    assert "size" in choices


def _compressions(cfg, out) -> tuple[float, list[float]]:
    """The compression after the last early step of a run with ``cfg`` and after each
    late-stage step."""
    seen: dict[str, dict[int, float]] = {"early": {}, "late": {}}

    def progress(event):
        if event["kind"] == "step":
            seen[event["stage"]][event["step"]] = event["compression"]

    train_model(ToyTask(), "comera", cfg, out, progress=progress)
    early, late = seen["early"], seen["late"]
    return early[max(early)], [late[k] for k in sorted(late)]


def test_a_spectrum_late_stage_fixes_the_shape_when_it_starts(tmp_path):
    cfg = replace(CFG, lam=0.0, late_allocation="spectrum")
    start, spectrum = _compressions(cfg, tmp_path / "spectrum")
    _, pruned = _compressions(replace(cfg, late_allocation="prune"), tmp_path / "prune")
    assert len(spectrum) == len(pruned) == cfg.steps_late
    assert len(set(spectrum)) == 1 and spectrum[0] > start  # one shape, from the first step
    assert spectrum[0] == pytest.approx(pruned[-1], rel=0.1)  # where pruning ends
    assert pruned[0] < pruned[-1]  # pruning gets there along the steps


def test_the_late_landing_sets_when_pruning_reaches_the_target(tmp_path):
    cfg = replace(CFG, lam=0.0, steps_late=8)
    _, soon = _compressions(replace(cfg, late_landing=0.25), tmp_path / "soon")
    _, late = _compressions(replace(cfg, late_landing=1.0), tmp_path / "late")
    assert soon[1] == pytest.approx(soon[-1], rel=0.05)  # there after 0.25 * 8 = 2 steps
    assert late[1] < 0.95 * late[-1]


def test_dense_run_is_one_stage_and_learns(tmp_path):
    cfg = replace(CFG, steps_early=30, steps_late=10, format="dense")
    _, record = train_model(ToyTask(), "dense", cfg, tmp_path)
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
    whole, rec_whole = train_model(task, "comera", CFG, tmp_path / "a")
    train_model(task, "comera", CFG, tmp_path / "b", stop_after=stop_at)
    resumed, rec_resumed = train_model(task, "comera", CFG, tmp_path / "b", resume=True)
    _assert_identical(_params(whole), _params(resumed))
    assert rec_whole.train_curve == rec_resumed.train_curve
    assert rec_whole.ranks == rec_resumed.ranks


def test_resume_refuses_other_settings_and_foreign_checkpoints(tmp_path):
    train_model(ToyTask(), "comera", CFG, tmp_path, stop_after=3)
    with pytest.raises(comera.CheckpointError, match="lr"):
        train_model(ToyTask(), "comera", replace(CFG, lr=0.5), tmp_path, resume=True)
    path = tmp_path / "checkpoints" / "comera.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(comera.CheckpointError):
        train_model(ToyTask(), "comera", CFG, tmp_path, resume=True)


def _toy_model(parametrization: str):
    def build():
        first = comera.TTLinear(32, 32, (4, 8), (8, 4), 6, dtype=torch.float64,
                                parametrization=parametrization)
        return torch.nn.Sequential(first, torch.nn.Tanh(), torch.nn.Linear(32, 4,
                                                                           dtype=torch.float64))
    return build


@pytest.mark.parametrize(("before", "after"), [("plain", "balanced"), ("balanced", "plain")])
def test_resume_refuses_another_parametrization(tmp_path, before, after):
    """Issue 42, item 4: resuming with the parametrization changed was accepted and silently
    ignored (the load takes the saved cores' multipliers with them)."""
    train_model(ToyTask(), "comera", CFG, tmp_path, stop_after=3,
                build=_toy_model(before))
    with pytest.raises(comera.CheckpointError,
                       match=rf"the {before} parametrization .* built with the {after} one .*"
                             rf"parametrization='{before}'"):
        train_model(ToyTask(), "comera", CFG, tmp_path, resume=True,
                    build=_toy_model(after))
    _, record = train_model(ToyTask(), "comera", CFG, tmp_path, resume=True,
                            build=_toy_model(before))  # the same one resumes
    assert record.steps == CFG.total_steps


_KILL_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
sys.path[:0] = [{root!r}]
from pathlib import Path
from tests.helpers.toy_task import ToyTask
from comera.experiments.engine import EngineConfig, train_model
cfg = EngineConfig(**{cfg!r})
train_model(ToyTask(delay={delay}), "comera", cfg, Path({out!r}))
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
    with pytest.raises(comera.ConfigError, match=f"in use by another run \\(pid {proc.pid}\\)"):
        train_model(ToyTask(), "comera", cfg, tmp_path / "killed", resume=True)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    step_at_kill = torch.load(ckpt, weights_only=True)["extra"]["engine"]["step"]
    # the kernel dropped the killed run's lock: the resume below may hold the directory
    assert 8 <= step_at_kill < cfg.total_steps
    resumed, _ = train_model(ToyTask(), "comera", cfg, tmp_path / "killed", resume=True)
    whole, _ = train_model(ToyTask(), "comera", cfg, tmp_path / "whole")
    _assert_identical(_params(whole), _params(resumed))


# -- faults -------------------------------------------------------------------------------------
def test_nonfinite_loss_stops_and_names_the_last_good_checkpoint(tmp_path):
    stream = IndexStream(256, CFG.batch_size, CFG.seed)
    poisoned = int(stream.indices(9)[0])  # first seen at step 9
    task = ToyTask(poison=(poisoned,))
    cfg = replace(CFG, checkpoint_every=4)
    with pytest.raises(comera.TrainingStopped, match=r"comera\.pt") as info:
        train_model(task, "comera", cfg, tmp_path)
    assert "step 9" in str(info.value)
    saved = torch.load(tmp_path / "checkpoints" / "comera.pt", weights_only=True)
    assert saved["extra"]["engine"]["step"] == 8
    assert all(torch.isfinite(v).all() for v in saved["model"].values())


def test_nonfinite_loss_skip_policy_drops_the_batch_and_keeps_the_model_finite(tmp_path):
    stream = IndexStream(256, CFG.batch_size, CFG.seed)
    poisoned = int(stream.indices(3)[0])
    cfg = replace(CFG, on_nonfinite="skip", format="dense")
    model, record = train_model(ToyTask(poison=(poisoned,)), "dense", cfg, tmp_path)
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


# -- settings and the run directory, checked before any training -------------------------------
class _CountingTask(ToyTask):
    """ToyTask that counts the batches it serves (zero: nothing was trained)."""

    served = 0

    def batch(self, indices):
        type(self).served += 1
        return super().batch(indices)


@pytest.mark.parametrize("changes, match", [
    ({"steps_early": 0}, "steps_early=0"),  # the dense run used to train, then comera refused
    ({"device": "tpu"}, "tpu"),
    ({"device": "cuda:7"} if torch.cuda.is_available() else {"device": "cuda"}, "cuda"),
    ({"steps_early": 0, "steps_late": 0, "stage": "both"}, "nothing would be trained"),
])
def test_run_experiment_checks_settings_before_any_training(tmp_path, changes, match):
    _CountingTask.served = 0
    with pytest.raises(comera.ConfigError, match=match):
        run_experiment(_CountingTask(), replace(CFG, **changes), tmp_path / "run")
    assert _CountingTask.served == 0
    assert not (tmp_path / "run").exists()


def test_check_settings_refuses_a_batch_the_workers_cannot_split():
    check_settings(CFG, world_size=2)  # 16 over 2
    with pytest.raises(comera.ConfigError, match="multiple of the worker count"):
        check_settings(replace(CFG, batch_size=7), world_size=2)
    with pytest.raises(comera.ConfigError, match="late stage takes its loss target"):
        check_settings(replace(CFG, steps_early=0))
    check_settings(replace(CFG, steps_early=0, format="dense"))  # a dense run needs no early steps


def test_resume_without_a_checkpoint_is_refused_and_writes_nothing(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(comera.CheckpointError, match="no checkpoint"):
        run_experiment(ToyTask(), CFG, tmp_path, resume=True)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoints"]
    assert not any((tmp_path / "checkpoints").iterdir())


_TRY_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("free")
except BlockingIOError:
    print("busy")
"""


def test_a_held_run_directory_is_locked_and_names_its_holder(tmp_path):
    with hold_run_directory(tmp_path) as held:
        assert (held / LOCK_NAME).read_text().strip() == str(os.getpid())
        with hold_run_directory(tmp_path):  # nested in the same process: allowed
            pass
        # another process cannot take the lock (a plain flock: no torch import, fast)
        done = subprocess.run([sys.executable, "-c", _TRY_LOCK, str(held / LOCK_NAME)],
                              capture_output=True, text=True, timeout=60)
        assert done.stdout.strip() == "busy", done.stderr
    assert not (tmp_path / LOCK_NAME).exists()  # released and removed on a clean exit
    with hold_run_directory(tmp_path):
        pass


def test_an_unwritable_run_directory_is_refused_before_training(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    _CountingTask.served = 0
    with pytest.raises(comera.ConfigError, match="is a file"):
        train_model(_CountingTask(), "dense", replace(CFG, format="dense"), target)
    if os.geteuid() != 0:
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o555)
        try:
            with pytest.raises(comera.ConfigError, match="not writable"):
                train_model(_CountingTask(), "dense", replace(CFG, format="dense"), folder)
        finally:
            folder.chmod(0o755)
    assert _CountingTask.served == 0


def test_progress_events_carry_no_loss_before_the_first_step(tmp_path):
    events = []
    train_model(ToyTask(), "dense", replace(CFG, steps_early=6, steps_late=0, format="dense"),
                tmp_path, progress=events.append)
    evals = [e for e in events if e["kind"] == "eval"]
    assert evals[0]["step"] == 0 and evals[0]["loss"] is None  # was nan
    assert all(isinstance(e["loss"], float) for e in evals[1:])


def test_summary_table_says_n_a_and_removed_instead_of_nan_and_dense_sizes(tmp_path):
    summary = run_experiment(ToyTask(), CFG, tmp_path, variants=("comera",))
    table = summary_table(summary)
    assert "nan" not in table and "| n/a |" in table  # no dense row: no speed-up
    row = summary["rows"][-1]
    removed = {**row, "sizes": {**row["sizes"], "tt_params": 0, "tt_compression": 5e5}}
    table = summary_table({**summary, "rows": [removed]})
    assert "removed" in table and "500000.0x" not in table


def test_engine_config_rejects_bad_values():
    with pytest.raises(comera.ConfigError, match="stage"):
        EngineConfig(stage="middle")
    with pytest.raises(comera.ConfigError, match="on_nonfinite"):
        EngineConfig(on_nonfinite="ignore")
    with pytest.raises(comera.ConfigError, match="target_compression"):
        EngineConfig(target_compression=1.0)
    with pytest.raises(comera.ConfigError, match="batch_size"):
        EngineConfig(batch_size=0)
    with pytest.raises(comera.ConfigError, match="late_allocation='grow'; choose one of"):
        EngineConfig(late_allocation="grow")
    for landing in (0, 1.5, True):
        with pytest.raises(comera.ConfigError, match="late_landing"):
            EngineConfig(late_landing=landing)
    with pytest.raises(comera.ConfigError, match=r"late_allocation='spectrum' with "
                                                 r"format='tucker'.*tensor-train chains"):
        EngineConfig(format="tucker", late_allocation="spectrum")


def test_an_early_stage_size_target_stops_pruning_there(tmp_path):
    cfg = replace(CFG, stage="early", steps_late=0, steps_early=30, lam=5.0, early_target=2.0,
                  early_landing=0.5)
    model, _ = train_model(ToyTask(), "comera", cfg, tmp_path)
    target = comera.training.early.EarlyStage.for_compression(ToyTask().build_model("tt"), 2.0)
    slice_ = max(max(m.layout.slice_costs(m.bond_ranks)) for _, m in comera.gated_layers(model))
    assert comera.model_size(model) >= target.target_size - 2 * slice_
    free, _ = train_model(ToyTask(), "comera", replace(cfg, early_target=None),
                          tmp_path / "free")
    assert comera.model_size(free) < comera.model_size(model)  # lam 5 alone prunes further
