"""The README's promise, case by case: bad input to ``comera`` gives exit code 2, exactly one line
on stderr, no traceback, and writes or changes nothing (snapshots of the folders before/after).

Every case runs in-process through ``comera.cli.main`` by default (fast: the checks come before
any training); a few also run as a real ``python -m comera.cli`` subprocess, and all of them do
under ``-m slow``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import comera
from comera.cli import main
from comera.experiments.rundir import LOCK_NAME
from tests.helpers import ROOT

_HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
print("held", flush=True)
sys.stdin.read()
"""


def _snapshot(*folders: Path) -> dict[str, tuple]:
    """Every file and folder under ``folders``: (size, mtime, sha256) or "dir"."""
    seen: dict[str, tuple] = {}
    for folder in folders:
        if not folder.exists():
            seen[str(folder)] = ("absent",)
            continue
        for path in [folder, *folder.rglob("*")] if folder.is_dir() else [folder]:
            if path.is_dir():
                seen[str(path)] = ("dir",)
            else:
                data = path.read_bytes()
                seen[str(path)] = (len(data), path.stat().st_mtime_ns,
                                   hashlib.sha256(data).hexdigest())
    return seen


def _files(tmp: Path) -> dict[str, Path]:
    torch.manual_seed(0)
    files = {name: tmp / f"{name}.pt"
             for name in ("model", "state_dict", "tensor", "checkpoint", "garbage", "empty",
                          "text")}
    torch.save(nn.Sequential(nn.Linear(8, 8)), files["model"])
    torch.save(nn.Linear(8, 8).state_dict(), files["state_dict"])
    torch.save(torch.randn(3), files["tensor"])
    comera.save_checkpoint(files["checkpoint"],
                           nn.Sequential(comera.TTLinear(16, 16, (4, 4), (4, 4), 2)))
    files["garbage"].write_bytes(b"not a torch file " * 20)
    files["empty"].write_bytes(b"")
    files["text"].write_text("root:x:0:0:root:/root:/bin/bash\n")  # as /etc/passwd
    return files


def _unwritable(tmp: Path) -> Path:
    """A directory this process cannot write: chmod for a normal user; as root (who writes
    through permissions) the read-only /sys, where there is one."""
    if os.geteuid() != 0:
        folder = tmp / "readonly"
        folder.mkdir()
        (folder / "old.txt").write_text("kept")
        folder.chmod(0o555)
        return folder
    try:
        with tempfile.TemporaryFile(dir="/sys"):
            pass
    except OSError:
        return Path("/sys")
    pytest.skip("running as root without a read-only directory to try")


# (id, argv from (tmp, files, out), words stderr must contain, setup(tmp, out) or None)
Case = tuple[str, Callable, tuple[str, ...], Callable | None]


def _hold_lock(tmp: Path, out: Path):
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(out / LOCK_NAME)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _old_run(tmp: Path, out: Path):
    (out / "checkpoints").mkdir(parents=True)
    (out / "notes.txt").write_text("a run directory without checkpoints")


CASES: list[Case] = [
    ("train-device-tpu", lambda t, f, o: ["train", "mlm", "--device", "tpu", "--out", o],
     ("tpu", "--device"), None),
    ("train-steps-0", lambda t, f, o: ["train", "transformer", "--quick", "--steps", "0",
                                       "--out", o], ("steps_early=0", "--steps"), None),
    ("train-batch-not-split-over-nproc",
     lambda t, f, o: ["train", "dlrm", "--quick", "--batch-size", "7", "--nproc", "2",
                      "--out", o], ("batch_size=7", "2 workers"), None),
    ("train-resume-without-checkpoints",
     lambda t, f, o: ["train", "dlrm", "--quick", "--resume", "--out", o],
     ("--resume", "no checkpoint"), _old_run),
    ("train-out-held-by-another-run", lambda t, f, o: ["train", "dlrm", "--quick", "--out", o],
     ("in use by another run", "pid"), _hold_lock),
    ("train-checkpoint-blocks-without-blocks",
     lambda t, f, o: ["train", "dlrm", "--quick", "--checkpoint-blocks", "--out", o],
     ("--checkpoint-blocks", "dlrm", "transformer"), None),
    ("train-parametrization-of-a-task-without-one",
     lambda t, f, o: ["train", "dlrm", "--quick", "--parametrization", "plain", "--out", o],
     ("--parametrization", "dlrm", "mlm, lm"), None),
    ("train-out-is-a-file", lambda t, f, o: ["train", "dlrm", "--quick", "--out", f["model"]],
     ("is a file",), None),
    ("report-empty", lambda t, f, o: ["report", f["empty"]], ("empty",), None),
    ("report-whole-model", lambda t, f, o: ["report", f["model"]],
     ("pickled", "comera convert"), None),
    ("report-garbage", lambda t, f, o: ["report", f["garbage"]], ("cannot be read",), None),
    ("convert-set-wrong-type", lambda t, f, o: ["convert", f["model"], "-o", t / "o.pt", "--set",
                                                "ranks=abc"], ("ranks", "abc", "int"), None),
    ("convert-missing-output-folder",
     lambda t, f, o: ["convert", f["model"], "-o", t / "missing" / "x.pt"],
     ("missing", "does not exist"), None),
    ("convert-output-is-a-folder", lambda t, f, o: ["convert", f["model"], "-o", t],
     ("is a directory",), None),
    ("convert-state-dict", lambda t, f, o: ["convert", f["state_dict"], "-o", t / "o.pt"],
     ("state dict", "not an nn.Module"), None),
    ("convert-checkpoint", lambda t, f, o: ["convert", f["checkpoint"], "-o", t / "o.pt"],
     ("comera checkpoint", "comera report"), None),
    ("convert-tensor", lambda t, f, o: ["convert", f["tensor"], "-o", t / "o.pt"],
     ("tensor", "not an nn.Module"), None),
    ("convert-garbage", lambda t, f, o: ["convert", f["garbage"], "-o", t / "o.pt"],
     ("not a torch file",), None),
    ("convert-empty", lambda t, f, o: ["convert", f["empty"], "-o", t / "o.pt"],
     ("not a torch file", "empty"), None),
    # issue 34, item 12
    ("convert-unreachable-target",
     lambda t, f, o: ["convert", f["model"], "-o", t / "o.pt", "--set",
                      "target_compression=1e308"],
     ("target_compression=1e+308 cannot be reached", "nothing was written"), None),
    ("convert-output-exists", lambda t, f, o: ["convert", f["model"], "-o", f["tensor"]],
     ("exists", "--force"), None),
    ("convert-output-is-the-input",
     lambda t, f, o: ["convert", f["model"], "-o", f["model"], "--force"],
     ("the model file being converted",), None),
    ("train-init-from-a-text-file",
     lambda t, f, o: ["train", "transformer", "--quick", "--init-from", f["text"], "--out", o],
     ("--init-from", "not a torch file", "root:x"), None),
    # issue 42, item 8: numbers too large for a float, JSON nested past any parser's depth
    ("convert-set-target-size-of-401-digits",
     lambda t, f, o: ["convert", f["model"], "-o", t / "o.pt", "--set", "allocation=global",
                      "--set", "target_size=1" + "0" * 400],
     ("--set 'target_size=1000", "401 digits", "too large for a float"), None),
    ("convert-set-target-compression-of-401-digits",
     lambda t, f, o: ["convert", f["model"], "-o", t / "o.pt", "--set",
                      "target_compression=1" + "0" * 400], ("target_compression", "401 digits"),
     None),
    ("convert-set-damping-of-401-digits",
     lambda t, f, o: ["convert", f["model"], "-o", t / "o.pt", "--set", "damping=1" + "0" * 400],
     ("damping", "401 digits"), None),
    ("convert-set-ranks-of-5001-digits",
     lambda t, f, o: ["convert", f["model"], "-o", t / "o.pt", "--set", "ranks=1" + "0" * 5000],
     ("ranks", "too long to read"), None),
    ("convert-config-text-of-401-digits",
     lambda t, f, o: ["convert", f["model"], "-o", t / "o.pt", "--config",
                      '{"damping": 1' + "0" * 400 + "}"], ("--config", "401 digits"), None),
    ("convert-config-nested-50000-deep",
     lambda t, f, o: ["convert", f["model"], "-o", t / "o.pt", "--config", t / "deep.json"],
     ("--config", "nests more than 16 levels"),
     lambda t, o: (t / "deep.json").write_text("[" * 50_000 + "]" * 50_000) and None),
    ("convert-set-nested-50000-deep",
     lambda t, f, o: ["convert", f["model"], "-o", t / "o.pt", "--set",
                      "modes=" + "[" * 50_000 + "]" * 50_000], ("--set 'modes=[[[", "nests"),
     None),
]
if not torch.cuda.is_available():
    CASES.append(("train-device-cuda-without-cuda",
                  lambda t, f, o: ["train", "mlm", "--device", "cuda", "--out", o],
                  ("CUDA is not available",), None))
# the cases that also run as a subprocess in the default run (the rest under -m slow)
SUBPROCESS_DEFAULT = {"train-batch-not-split-over-nproc", "report-whole-model",
                      "convert-set-wrong-type", "convert-unreachable-target",
                      "convert-config-nested-50000-deep", "convert-set-target-size-of-401-digits"}


def _run(argv: list[str], subprocess_run: bool, capsys) -> tuple[int, str]:
    if subprocess_run:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "COMERA_NO_PROGRESS": "1"}
        done = subprocess.run([sys.executable, "-m", "comera.cli", *argv], capture_output=True,
                              text=True, env=env, timeout=300)
        return done.returncode, done.stderr
    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().err


def _params():
    out = []
    for case in CASES:
        out.append(pytest.param(case, False, id=f"{case[0]}-in-process"))
        marks = () if case[0] in SUBPROCESS_DEFAULT else (pytest.mark.slow,)
        out.append(pytest.param(case, True, id=f"{case[0]}-subprocess", marks=marks))
    return out


@pytest.mark.parametrize("case, subprocess_run", _params())
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, case,
                                                            subprocess_run):
    name, argv_of, needles, setup = case
    files = _files(tmp_path)
    out = tmp_path / "run"
    holder = setup(tmp_path, out) if setup else None
    try:
        before = _snapshot(tmp_path)
        code, err = _run([str(a) for a in argv_of(tmp_path, files, out)], subprocess_run, capsys)
        assert code == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("comera: error: "), err
        assert "Traceback" not in err and "\x1b" not in err, err
        for needle in needles:
            assert needle in err, (needle, err)
        if name == "train-out-held-by-another-run":
            assert f"pid {holder.pid}" in err
        time.sleep(0.01)
        assert _snapshot(tmp_path) == before, "a refused command changed files"
    finally:
        if holder is not None:
            holder.stdin.close()
            holder.wait(timeout=30)


def test_unwritable_out_is_refused_before_training(tmp_path, capsys):
    folder = _unwritable(tmp_path)
    try:
        for out in (folder, folder / "new_run"):
            before = _snapshot(folder) if folder != Path("/sys") else sorted(os.listdir(folder))
            code, err = _run(["train", "dlrm", "--quick", "--out", str(out)], False, capsys)
            assert code == 2 and len(err.strip().splitlines()) == 1, err
            assert "not writable" in err and "Traceback" not in err, err
            after = _snapshot(folder) if folder != Path("/sys") else sorted(os.listdir(folder))
            assert after == before
    finally:
        if folder != Path("/sys"):
            folder.chmod(0o755)


def test_convert_help_says_the_input_must_be_trusted(capsys):
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "trust" in text and "runs code" in text
