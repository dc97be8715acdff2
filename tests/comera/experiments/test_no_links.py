"""Nothing the project writes goes through a symbolic link planted at its final path, and a
summary is written whole or not at all (issue 26, item 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import comera
from comera.data.cache import write_cached
from comera.experiments.results import write_summary
from comera.experiments.rundir import LOCK_NAME, check_run_directory, hold_run_directory
from comera.surgery.pretrained import HF_CONFIG, RECORDS, WEIGHTS, save_pretrained

SUMMARY = {"task": "toy", "metric": "loss", "higher_is_better": False,
           "config": {"steps_early": 4, "steps_late": 0, "stage": "early"},
           "rows": [{"name": "dense", "stage": "dense", "step": 4, "ms_per_step": 1.0,
                     "speedup": 1.0, "val": {"loss": 0.5}, "test": {"loss": 0.5},
                     "sizes": {"model_params": 10}}],
           "runs": [{"name": "dense", "train_curve": [[0, 1.0, 1.0, "loss"]],
                     "val_curve": [[0, {"loss": 0.5}]], "ranks": []}]}


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim"
    path.write_text("DATA\n")
    return path


def _untouched(victim) -> None:
    assert victim.read_text() == "DATA\n"


def test_a_lock_planted_as_a_link_is_refused_and_its_target_untouched(tmp_path, victim):
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).symlink_to(victim)
    with pytest.raises(comera.ConfigError, match=r"symbolic link.*rm "):
        check_run_directory(out)
    with pytest.raises(comera.ConfigError, match="symbolic link"), hold_run_directory(out):
        pass
    _untouched(victim)
    (out / LOCK_NAME).unlink()  # dangling: the run would create its target
    (out / LOCK_NAME).symlink_to(tmp_path / "victim2")
    with pytest.raises(comera.ConfigError, match="symbolic link"), hold_run_directory(out):
        pass
    assert not (tmp_path / "victim2").exists()


def test_a_lock_that_is_a_fifo_is_refused_without_hanging(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / LOCK_NAME)
    with pytest.raises(comera.ConfigError, match="not a regular file"):
        check_run_directory(out)
    with pytest.raises(comera.ConfigError, match="not a regular file"), hold_run_directory(out):
        pass


def test_a_checkpoint_folder_planted_as_a_link_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoints").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(comera.ConfigError, match="checkpoints is a symbolic link"):
        check_run_directory(out)
    assert list(elsewhere.iterdir()) == []


def test_summary_files_replace_planted_links_instead_of_writing_through(tmp_path, victim):
    out = tmp_path / "out"
    out.mkdir()
    names = ["toy.json", "toy.md", "toy_curves.png", "toy_tradeoff.png"]
    for name in names:
        (out / name).symlink_to(victim)
    paths = write_summary(SUMMARY, out)
    _untouched(victim)
    for name in names:
        assert not (out / name).is_symlink() and (out / name) in paths
    assert json.loads((out / "toy.json").read_text())["task"] == "toy"


_FULL_DISK = """
import json, resource, signal, sys
from pathlib import Path
from comera.experiments.results import write_summary
summary = json.loads(sys.argv[2])
summary["runs"][0]["train_curve"] *= 20000        # a json of about 600 kB
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # writes past the limit fail with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
try:
    write_summary(summary, Path(sys.argv[1]))
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_a_failed_summary_write_leaves_the_old_files_whole(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "toy.json").write_text('{"old": 1}')
    (out / "toy.md").write_text("old table\n")
    done = subprocess.run([sys.executable, "-c", _FULL_DISK, str(out), json.dumps(SUMMARY)],
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith("TrainingStopped could not write"), done.stdout + done.stderr
    assert "--resume" in done.stdout and "\n" not in done.stdout.strip()
    assert (out / "toy.json").read_text() == '{"old": 1}'  # was left half rewritten
    assert (out / "toy.md").read_text() == "old table\n"
    assert not [p for p in os.listdir(out) if p.endswith(".part")]


def test_checkpoints_caches_and_pretrained_folders_replace_planted_links(tmp_path, victim):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    ckpt = tmp_path / "model.pt"
    ckpt.symlink_to(victim)
    comera.save_checkpoint(ckpt, model)
    cache = tmp_path / "cache.pt"
    cache.symlink_to(victim)
    write_cached(cache, {"x": torch.zeros(2)})
    folder = tmp_path / "pretrained"
    folder.mkdir()
    for name in (WEIGHTS, RECORDS, HF_CONFIG):
        (folder / name).symlink_to(victim)
    save_pretrained(model, folder)
    _untouched(victim)
    for path in (ckpt, cache, folder / WEIGHTS, folder / RECORDS):
        assert path.is_file() and not path.is_symlink()


def test_taking_a_run_folder_sweeps_killed_writes_temp_files_whatever_their_age(tmp_path):
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    fresh = [out / "checkpoints" / ".comera.pt.999-0123456789abcdef.part",
             out / ".toy.json.999-0123456789abcdef.part"]
    for part in fresh:
        part.write_bytes(b"x" * 100)  # just written: age 0 (was kept for 10 minutes)
    keep = out / "checkpoints" / "comera.pt"
    keep.write_bytes(b"y")
    with hold_run_directory(out):
        assert not any(p.exists() for p in fresh)
    assert keep.exists()
