"""benchmarks/studies/lm_frontier.py (on benchmarks/studies/frontier.py): budgets of the
baselines, and a --smoke run on a tiny corpus."""

from __future__ import annotations

import json

import pytest

from benchmarks.studies import frontier, lm_frontier
from comera.experiments.lm_task import LMTask, LMTaskConfig
from comera.layers.linear import TTLinear
from tests.helpers.tiny_corpus import write_tiny_corpus


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_stdlib")
    write_tiny_corpus(path)
    return path


@pytest.mark.parametrize("target", [2.0, 4.0, 8.0])
def test_uniform_ranks_are_the_largest_within_the_budget(root, target):
    task = LMTask(LMTaskConfig(seq_len=16, vocab_size=64, d_model=32, n_heads=2, d_ff=64,
                               n_layers=1), root=root, use_cache=False)
    shapes = [(m.in_features, m.out_features) for _, m in task.block_linears(task.build())]
    assert len(shapes) == 6
    budget = sum(i * o for i, o in shapes) / target
    r = frontier.uniform_rank(task, "lowrank", target)
    assert r * sum(i + o for i, o in shapes) <= budget < (r + 1) * sum(i + o for i, o in shapes)
    assert frontier.linear_sizes(task, task.build("lowrank", r))[0] <= budget

    def tt_size(rank):
        return sum(TTLinear(i, o, ranks=rank, bias=False).num_parameters() for i, o in shapes)

    r = frontier.uniform_rank(task, "tt", target)
    assert tt_size(r) <= budget < tt_size(r + 1)
    assert frontier.linear_sizes(task, task.build("tt", r))[0] == tt_size(r)


@pytest.mark.slow
def test_smoke_run_writes_all_four_methods(root, tmp_path):
    out = tmp_path / "out"
    argv = ["--smoke", "--root", str(root), "--seeds", "0", "--targets", "4", "--out", str(out),
            "--work", str(tmp_path / "work"), "--tag", "smoke", "--max-rank", "4"]
    assert lm_frontier.main(argv) == 0
    result = json.loads((out / "frontier.json").read_text())
    methods = {r["method"] for r in result["rows"]}
    assert methods == {"dense", "comera early", "comera", "fixed", "lowrank"}
    for row in result["rows"]:
        assert row["val"]["perplexity"] > 1 and row["test"]["loss"] > 0
        if row["method"] in ("fixed", "lowrank"):
            assert row["compression"] >= 4.0
    assert result["runs"][0]["command"].startswith(
        "python -m benchmarks.studies.lm_frontier --smoke")
    assert result["runs"][0]["machine"]["cpu"]
    text = (out / "frontier.md").read_text()
    assert "fixed uniform TT rank" in text and "low-rank" in text and "CoMERA" in text
    # a second call reuses the early model and adds its rows next to the first call's
    assert lm_frontier.main([*argv[:-4], "--tag", "more", "--methods", "comera",
                             "--max-rank", "4"]) == 0
    merged = json.loads((out / "frontier.json").read_text())
    assert len(merged["rows"]) == len(result["rows"]) + 1
