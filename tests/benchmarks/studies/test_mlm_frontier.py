"""benchmarks/studies/mlm_frontier.py and the MLM task's frontier models: the encoder's block linear
layers of each kind, and a --smoke run of every method on a tiny corpus the test writes."""

from __future__ import annotations

import json

import pytest
from torch import nn

from benchmarks.studies import mlm_frontier
from benchmarks.studies.harness.runs import layer_ranks
from comera import ConfigError, GatedLinear
from comera.experiments.mlm_task import MLMTask, MLMTaskConfig
from comera.layers.linear import TTLinear
from tests.helpers.tiny_corpus import write_tiny_corpus


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_stdlib")
    write_tiny_corpus(root)
    return MLMTask(MLMTaskConfig(seq_len=16, vocab_size=64, d_model=32, n_heads=2, d_ff=64,
                                 n_layers=1, eval_limit=8), root=root, use_cache=False)


@pytest.mark.parametrize(("kind", "cls"), [("dense", nn.Linear), ("tt", TTLinear),
                                           ("lowrank", GatedLinear), ("btt", GatedLinear)])
def test_build_swaps_only_the_block_linear_layers(task, kind, cls):
    model = task.build(kind, 3)
    layers = task.block_linears(model)
    assert [n for n, _ in layers] == [f"blocks.0.{n}" for n in (
        "attn.q", "attn.k", "attn.v", "attn.o", "ffn_in", "ffn_out")]
    assert all(type(m) is cls and m.bias is not None for _, m in layers)
    assert type(model.decoder) is nn.Linear and type(model.tokens) is nn.Embedding
    batch = task.batch([0, 1], 0)
    assert task.loss(model, batch).isfinite()
    ranks = layer_ranks(layers)
    if kind == "tt":
        assert max(ranks["blocks.0.ffn_in"]) == 3
    elif kind == "lowrank":
        assert ranks["blocks.0.ffn_in"] == [3]
    elif kind == "dense":
        assert ranks == {}
    narrow = task.build(kind, 3, d_model=16, d_ff=40)
    assert narrow.blocks[0].ffn_in.out_features == 40 and narrow.positions.weight.shape[1] == 16


def test_build_rejects_unknown_kinds_and_ranks(task):
    with pytest.raises(ConfigError, match="format='einsum'"):
        task.build("einsum")
    with pytest.raises(ConfigError, match="rank=0"):
        task.build("tt", 0)


@pytest.mark.slow
def test_smoke_run_writes_every_method(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    write_tiny_corpus(root)
    out = tmp_path / "out"
    argv = ["--smoke", "--root", str(root), "--seeds", "0", "--targets", "4", "--out", str(out),
            "--work", str(tmp_path / "work"), "--tag", "smoke", "--max-rank", "4",
            "--methods", "dense", "tt", "lowrank", "comera", "spectrum"]
    assert mlm_frontier.main(argv) == 0
    result = json.loads((out / "frontier.json").read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"dense", "comera early", "comera", "spectrum", "tt", "lowrank"}
    for method in ("comera", "spectrum", "tt", "lowrank"):
        assert rows[method]["compression"] >= 4.0 * 0.99, method
    assert rows["spectrum"]["decide"] == 2
    text = (out / "frontier.md").read_text()
    assert "spectrum allocation" in text and "test vs dense" in text
    assert (out / "frontier.png").is_file()
