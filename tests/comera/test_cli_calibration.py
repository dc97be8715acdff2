"""``comera convert --calibration`` (comera/cli.py): calibrated, globally allocated conversion
from the terminal with per-layer ranks and output errors in the report; a missing, empty, code-
carrying or rejected calibration file exits 2 with nothing written."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import comera
from tests.comera.test_cli import run_cli


@pytest.fixture
def files(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 32), nn.Tanh(), nn.Linear(32, 24))
    torch.save(model, tmp_path / "model.pt")
    torch.save([torch.randn(16, 24) for _ in range(3)], tmp_path / "batches.pt")
    return tmp_path


def test_calibrated_global_conversion_from_the_terminal(files):
    out = files / "out.pt"
    result = run_cli("convert", str(files / "model.pt"), "-o", str(out), "--set",
                     "target_compression=2", "--set", "allocation=global", "--calibration",
                     str(files / "batches.pt"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "output err" in lines[0]
    assert "3 calibration batch(es)" in result.stdout and "one size budget" in result.stdout
    model = torch.load(files / "model.pt", weights_only=False)
    comera.load_checkpoint(out, model)
    assert isinstance(model[0], comera.GatedLayer)


@pytest.mark.parametrize(("content", "match"), [
    (None, "no such file"),
    ([], "holds no batches"),
    ("text", "holds str"),
    ([torch.randn(4, 9)], "batch 0: layer '0' received an input of shape (4, 9)"),
    (nn.Linear(2, 2), "not a torch file of tensors"),
])
def test_bad_calibration_files_exit_2_and_write_nothing(files, content, match):
    path = files / "bad.pt"
    if content is not None:
        torch.save(content, path)
    out = files / "out.pt"
    result = run_cli("convert", str(files / "model.pt"), "-o", str(out), "--set",
                     "target_compression=2", "--calibration", str(path))
    assert result.returncode == 2
    assert match in result.stderr and result.stderr.count("\n") == 1
    assert not out.exists()


class _Runs:
    """Pickles as a call of os.system: a planted file that would run a command if loaded."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_a_calibration_file_that_pickles_code_is_refused_with_the_whole_reason(files):
    """Issue 42, item 8: refused (good), but with torch's message cut before "arbitrary code
    execution"; now the object is named and the reason said whole, and nothing ran."""
    ran = files / "ran"
    torch.save([_Runs(f"touch {ran}")], files / "code.pt")
    out = files / "out.pt"
    result = run_cli("convert", str(files / "model.pt"), "-o", str(out), "--calibration",
                     str(files / "code.pt"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "system" in result.stderr and "arbitrary code" in result.stderr, result.stderr
    assert not ran.exists() and not out.exists()


def test_a_budget_no_allocation_meets_exits_2(files):
    out = files / "out.pt"
    result = run_cli("convert", str(files / "model.pt"), "-o", str(out), "--set",
                     "allocation=global", "--set", "target_size=3", "--calibration",
                     str(files / "batches.pt"))
    assert result.returncode == 2 and "cannot be met" in result.stderr
    assert not out.exists()
