"""The held-out GPT study: its fresh-cored conversion, a run end to end on a few files of text,
and a diverged run reported as the worst of its method's grid."""

import json
from types import SimpleNamespace

import pytest
import torch

import comera
from benchmarks.studies import heldout_gpt as study

TEXT = "".join(f"Section {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(40))


@pytest.fixture
def rst_root(tmp_path):
    root = tmp_path / "help"
    root.mkdir()
    for i in range(40):  # 90 / 10 by a hash of the name: both splits get files
        (root / f"page{i}.rst").write_text(TEXT * (1 + i % 3))
    return root


def test_fresh_conversion_redraws_the_cores_at_the_same_size(rst_root):
    task = study.ByteTask(rst_root, 16, 16, 1, 4)
    torch.manual_seed(0)
    decomposed = study.converted(task, "tt", "balanced", 4.0)
    torch.manual_seed(0)
    fresh = study.converted(task, "tt", study.FRESH, 4.0)
    layers = dict(comera.gated_layers(decomposed))
    fresh_layers = dict(comera.gated_layers(fresh))
    assert layers.keys() == fresh_layers.keys() and layers
    for name, layer in fresh_layers.items():
        assert layer.parametrization == "balanced"
        assert layer.bond_sizes == layers[name].bond_sizes
        # drawn anew: not the decomposition of the dense weight
        assert not torch.allclose(layer.to_dense(), layers[name].to_dense())
    assert sum(p.numel() for p in fresh.parameters()) == sum(
        p.numel() for p in decomposed.parameters())


def test_a_diverged_run_is_the_worst_of_its_grid():
    rows = [{"seed": 0, "method": "tt:fresh", "lr": 0.01, "params": 10,
             "val": {"loss": 2.5}},
            {"seed": 0, "method": "tt:fresh", "lr": 0.03, "diverged": "non-finite"}]
    args = SimpleNamespace(steps=5, lrs=[0.01, 0.03], target=8.0)
    text = study.report({"rows": rows, "narrow_width": 8, "command": "c",
                         "machine": {"cpu": "cpu", "torch": "t"}}, args)
    assert "| tt:fresh | 10 | 0.01 (grid edge) |" in text
    assert "0.03: diverged" in text


def test_the_study_runs_end_to_end(rst_root, tmp_path):
    out = tmp_path / "out"
    code = study.main(["--root", str(rst_root), "--methods", "dense", "tt:fresh",
                       "--lrs", "1e-3", "--steps", "2", "--warmup", "1", "--batch", "2",
                       "--d-model", "16", "--layers", "1", "--block", "16", "--target", "4",
                       "--out", str(out), "--work", str(tmp_path / "work")])
    assert code == 0
    payload = json.loads((out / "heldout.json").read_text())
    assert [r["method"] for r in payload["rows"]] == ["dense", "tt:fresh"]
    assert all(r["val"]["loss"] > 0 and "curves" not in r for r in payload["rows"])
    full = json.loads((out / "curves" / "heldout.json").read_text())
    assert all(r["curves"]["train"] for r in full["rows"])  # in the git-ignored copy
