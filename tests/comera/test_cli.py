"""The ``comera`` command in a subprocess: report and convert compute the right numbers, and bad
input gives one line, exit code 2 and no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import comera
from comera.surgery.report import checkpoint_report
from tests.helpers import ROOT


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COMERA_NO_PROGRESS": "1"}
    return subprocess.run([sys.executable, "-m", "comera.cli", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


def _tt_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(comera.TTLinear(64, 48, (4, 4, 4), (4, 4, 3), 5), nn.ReLU(),
                          nn.Linear(48, 10))
    with torch.no_grad():
        model[0].gates[1][:2] = 0.0  # prune two ranks of the middle bond
    return model


def test_report_prints_ranks_sizes_and_compression(tmp_path):
    model = _tt_model()
    path = tmp_path / "ckpt.pt"
    comera.save_checkpoint(path, model, step=7)
    result = run_cli("report", str(path))
    assert result.returncode == 0, result.stderr
    layer = model[0]
    assert str(list(layer.ranks[1:-1])) in result.stdout  # effective ranks [5, 3, 5, ...]
    assert str(list(layer.bonds[1:-1])) in result.stdout
    assert f"{layer.num_parameters(True):,}" in result.stdout
    ratio = layer.dense_num_parameters() / layer.num_parameters(True)
    assert f"{ratio:.1f}x" in result.stdout
    other = sum(p.numel() for p in model[2].parameters())
    assert f"{other:,} outside the TT layers" in result.stdout


def test_convert_writes_a_checkpoint_that_loads_into_the_original_architecture(tmp_path):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    torch.save(model, tmp_path / "model.pt")
    out = tmp_path / "tt.pt"
    result = run_cli("convert", str(tmp_path / "model.pt"), "-o", str(out), "--set", "ranks=64",
                     "--set", "d=2")
    assert result.returncode == 0, result.stderr
    assert "total" in result.stdout and out.is_file()
    fresh = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    comera.load_checkpoint(out, fresh)
    assert isinstance(fresh[0], comera.TTLinear) and isinstance(fresh[2], comera.TTLinear)
    x = torch.randn(5, 64)
    # full rank (64 >= every bond of a d=2 split of 64x64): the outputs are unchanged
    torch.testing.assert_close(fresh(x), model(x), rtol=1e-4, atol=1e-4)
    report = run_cli("report", str(out))
    assert report.returncode == 0 and "TT layers" in report.stdout, report.stderr


@pytest.mark.parametrize("args, needle", [
    (("report", "missing.pt"), "does not exist"),
    (("train", "resnet"), "unknown model 'resnet'"),
    (("train", "transformer", "--target-compression", "0.5"), "must be > 1"),
    (("train", "transformer", "--nproc", "0"), "--nproc 0"),
    (("convert", "missing.pt", "-o", "x.pt"), "does not exist"),
])
def test_bad_input_is_one_line_exit_2_no_traceback(tmp_path, args, needle):
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert needle in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_convert_rejects_a_state_dict_and_unknown_settings(tmp_path):
    torch.save(nn.Linear(4, 4).state_dict(), tmp_path / "sd.pt")
    result = run_cli("convert", str(tmp_path / "sd.pt"), "-o", str(tmp_path / "o.pt"))
    assert result.returncode == 2 and "not an nn.Module" in result.stderr
    torch.save(nn.Linear(4, 4), tmp_path / "m.pt")
    result = run_cli("convert", str(tmp_path / "m.pt"), "-o", str(tmp_path / "o.pt"),
                     "--set", "rankz=3")
    assert result.returncode == 2 and "rankz" in result.stderr
    result = run_cli("convert", str(tmp_path / "m.pt"), "-o", str(tmp_path / "o.pt"),
                     "--set", "ranks")
    assert result.returncode == 2 and "KEY=VALUE" in result.stderr


def test_report_refuses_a_damaged_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    comera.save_checkpoint(path, _tt_model())
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    result = run_cli("report", str(path))
    assert result.returncode == 2 and "truncated, corrupt" in result.stderr


def test_progress_line_before_the_first_step_has_no_loss(capsys):
    from comera.cli import _Bars

    event = {"kind": "eval", "name": "comera", "stage": "early", "step": 0, "total": 20,
             "loss": None, "metric": "loss", "value": 1.25, "compression": 1.0, "rank_total": 9}
    _Bars(False)(event)
    _Bars(False)({**event, "step": 5, "loss": 0.5})
    first, later = capsys.readouterr().out.splitlines()
    assert "nan" not in first and "loss 0." not in first and "val loss 1.2500" in first
    assert "loss 0.5000" in later


def test_report_says_removed_for_a_layer_pruned_to_nothing(tmp_path):
    from comera.surgery.report import checkpoint_report

    model = _tt_model()
    with torch.no_grad():
        model[0].gates[1].zero_()  # every rank of one bond pruned: the weight is gone
    path = tmp_path / "ckpt.pt"
    comera.save_checkpoint(path, model)
    text = str(checkpoint_report(path))
    dense = model[0].dense_num_parameters()
    assert "removed" in text
    assert f"{dense / max(model[0].num_parameters(True), 1):.1f}x" not in text


def test_a_target_compression_is_what_convert_and_report_print(tmp_path):
    """Issue 34, item 2: the rank rule counts biases as the report does (and as
    compression_ratio and the late stage do), so asking for 20x prints at least 20x."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    torch.save(model, tmp_path / "model.pt")
    out = tmp_path / "tt.pt"
    result = run_cli("convert", str(tmp_path / "model.pt"), "-o", str(out), "--set",
                     "target_compression=20")
    assert result.returncode == 0, result.stderr
    total = next(line for line in result.stdout.splitlines() if line.startswith("total"))
    assert float(total.split()[-1].rstrip("x")) >= 20, total
    report = checkpoint_report(out)
    assert report.compression >= 20
    assert all(r.compression >= 20 for r in report.layers)


def test_convert_replaces_an_existing_output_only_with_force(tmp_path):
    """Issue 34, item 12: -o of an existing file is refused (exit 2, the file kept) unless
    --force is given."""
    torch.manual_seed(0)
    torch.save(nn.Sequential(nn.Linear(16, 16)), tmp_path / "model.pt")
    out = tmp_path / "tt.pt"
    out.write_bytes(b"keep me")
    args = ("convert", str(tmp_path / "model.pt"), "-o", str(out), "--set", "ranks=2")
    refused = run_cli(*args)
    assert refused.returncode == 2 and "--force" in refused.stderr
    assert out.read_bytes() == b"keep me"
    forced = run_cli(*args, "--force")
    assert forced.returncode == 0, forced.stderr
    assert comera.read_checkpoint(out).layers


def test_convert_of_a_gpt2_loads_as_its_hint_says_and_warns_only_what_applies(tmp_path):
    """Issue 42, item 9: the hint "comera.load_checkpoint(path, model)" into the original
    architecture failed for a HuggingFace GPT-2 (Conv1D layers); and the command warned that
    HF's save_pretrained loses TT layers though it writes no HF folder."""
    transformers = pytest.importorskip("transformers")

    def gpt2():
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                         n_head=2, n_inner=16, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config).eval()

    torch.save(gpt2(), tmp_path / "gpt2.pt")
    out = tmp_path / "gpt2_tt.pt"
    result = run_cli("convert", str(tmp_path / "gpt2.pt"), "-o", str(out), "--set", "ranks=4")
    assert result.returncode == 0, result.stderr
    assert "save_pretrained" not in result.stderr, result.stderr
    assert "comera.load_checkpoint(path, model)" in result.stdout
    model = gpt2()  # the original architecture, unconverted, as the hint says
    comera.load_checkpoint(out, model)
    saved = comera.read_checkpoint(out)
    assert sorted(n for n, _ in comera.gated_layers(model)) == sorted(saved.layers)
    assert "transformer.h.0.attn.c_attn" in saved.layers
    state = model.state_dict()
    assert state.keys() == saved.model.keys()
    assert all(torch.equal(state[k], saved.model[k]) for k in state)
