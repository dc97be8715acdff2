"""Checkpoints and save_pretrained folders written before the format protocol (layer kinds
TTLinear / TTMLinear / TTEmbedding, modes and chain bonds) still load, report and resave; the
fixtures in data/ were written by main's record code (data/make_legacy.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import comera
from comera.surgery.report import checkpoint_report
from tests.comera.surgery.data.make_legacy import Net

DATA = Path(__file__).parent / "data"
CHECKPOINT = DATA / "legacy_checkpoint.pt"
FOLDER = DATA / "legacy_pretrained"


def test_the_fixtures_hold_the_old_record_shape():
    kinds = {n: r["kind"] for n, r in torch.load(CHECKPOINT, weights_only=True)["layers"].items()}
    assert kinds == {"emb": "TTEmbedding", "a": "TTLinear", "b": "TTMLinear"}
    records = json.loads((FOLDER / "comera_layers.json").read_text())
    assert records["version"] == 2 and records["layers"]["a"]["bonds"][0] == 1


@pytest.mark.parametrize("converted", [False, True])
def test_an_old_checkpoint_loads_into_a_dense_or_converted_model(converted):
    model = Net()
    if converted:  # at other ranks than saved: resized on load
        comera.convert_(model, include=["emb", "a"], embedding=True, ranks=2)
        comera.convert_(model, include=["b"], ranks=2, format="ttm")
    optimizer = comera.make_optimizer(model)
    extra = comera.load_checkpoint(CHECKPOINT, model, optimizer)
    assert (type(model.a).__name__, type(model.b).__name__) == ("TTLinear", "TTMLinear")
    with torch.no_grad():
        torch.testing.assert_close(model(extra["ids"]), extra["y"], rtol=0, atol=0)
    assert len(optimizer.state) == len(list(model.parameters()))


def test_an_old_checkpoint_reads_as_records_of_today():
    record = comera.read_checkpoint(CHECKPOINT)
    assert record.layers["a"]["kind"] == "GatedLinear" and record.layers["a"]["format"] == "tt"
    assert record.layers["b"]["format"] == "ttm"
    assert record.layers["emb"]["kind"] == "TTEmbedding"
    report = checkpoint_report(CHECKPOINT)
    rows = {r.name: r for r in report.layers}
    assert rows["a"].format == "tt" and rows["b"].format == "ttm"
    old = torch.load(CHECKPOINT, weights_only=True)["layers"]
    for name in ("a", "b", "emb"):  # the bonds main stored, without the chain's ends
        assert rows[name].bonds == tuple(old[name]["bonds"]), name
        assert rows[name].bond_sizes == tuple(old[name]["bonds"][1:-1]), name
    assert "ttm" in str(report)


def test_an_old_pretrained_folder_loads_and_resaves_in_todays_shape(tmp_path):
    expected = torch.load(DATA / "legacy_pretrained_expected.pt", weights_only=True)
    model = comera.from_pretrained(FOLDER, Net())
    with torch.no_grad():
        torch.testing.assert_close(model(expected["ids"]), expected["y"], rtol=0, atol=0)
    folder = shutil.copytree(FOLDER, tmp_path / "old")
    comera.save_pretrained(model, tmp_path / "new")
    records = json.loads((tmp_path / "new" / "comera_layers.json").read_text())
    assert {r["kind"] for r in records["layers"].values()} == {"GatedLinear", "TTEmbedding"}
    again = comera.from_pretrained(tmp_path / "new", Net())
    with torch.no_grad():
        torch.testing.assert_close(again(expected["ids"]), expected["y"], rtol=0, atol=0)
    assert comera.from_pretrained(folder, Net()) is not None
