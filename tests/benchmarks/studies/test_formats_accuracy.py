"""The formats-accuracy script: each format's model hits the size budget, is initialised as the
fixed-rank TT model is, and a smoke run writes a well-formed results file."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.studies.formats_accuracy import main, plan, study_of, trained_formats
from benchmarks.studies.harness.reviews import SmallReviews
from benchmarks.studies.harness.runs import layer_sizes
from comera.experiments.transformer_task import ReviewsTaskConfig
from comera.layers.linear import GatedLinear
from comera.ranks.budget import linear_size


@pytest.fixture(scope="module")
def task():
    return SmallReviews(ReviewsTaskConfig(max_len=64))


def _study(task, tmp_path):
    import argparse

    args = argparse.Namespace(batch=32, lr=1e-3, lr_gates=1e-2, warmup=1, eval_every=2,
                              threads=1, work=tmp_path, steps=2)
    return study_of(task, args)


def test_every_format_but_the_declared_one_is_trained():
    assert "einsum" not in trained_formats() and "dense" not in trained_formats()
    assert {"tt", "ttm", "tucker", "cp", "lowrank", "tr", "btt"} <= set(trained_formats())


def test_each_model_hits_the_budget_at_the_largest_rank(task, tmp_path):
    study = _study(task, tmp_path)
    the_plan = plan(study, trained_formats(), 50.0)
    shapes = study.shapes()
    assert len(shapes) == 12  # q, k, v, o, ffn_in, ffn_out in 2 blocks
    budget = the_plan["budget"]
    assert budget == pytest.approx(the_plan["dense_linear"] / 50)
    for fmt, p in the_plan["formats"].items():
        if not p["fits"]:  # reported with its rank-1 size, which is over the budget
            assert p["linear_params"] == linear_size(fmt, shapes, 1) > budget, fmt
            assert study.uniform_rank(fmt, 50.0) == 0
            continue
        assert study.uniform_rank(fmt, 50.0) == p["rank"], fmt  # the plan is what trains
        model = task.build(fmt, p["rank"])
        layers = [m for n, m in model.named_modules() if isinstance(m, GatedLinear)]
        assert len(layers) == 12 and all(m.format.name == fmt for m in layers), fmt
        params, dense = layer_sizes(task.block_linears(model))  # what the rows report
        assert params == p["linear_params"] <= budget, fmt
        larger = linear_size(fmt, shapes, p["rank"] + 1)
        assert larger > budget or larger == linear_size(fmt, shapes, 512), fmt  # or capped
        assert dense == the_plan["dense_linear"]
        assert p["compression"] == pytest.approx(dense / params)


def test_tt_model_is_the_fixed_rank_model(task):
    torch.manual_seed(3)
    ours = task.build("tt", 4)
    torch.manual_seed(3)
    from dataclasses import replace

    from comera.models import PairClassifier

    fixed = PairClassifier(replace(task.model_config("tt"), rank=4))
    a, b = ours.state_dict(), fixed.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    cp = task.build("cp", 2)
    assert {type(m).__name__ for n, m in cp.named_modules() if n.endswith(".q")} == {
        "GatedLinear"}


def test_smoke_run_writes_rows_and_the_table(tmp_path, capsys):
    common = ["--smoke", "--seeds", "0", "--out", str(tmp_path / "out"), "--work",
              str(tmp_path / "work")]
    assert main([*common, "--formats", "lowrank", "btt"]) == 0
    result = json.loads((tmp_path / "out" / "formats.json").read_text())
    assert {"torch", "cpu", "threads"} <= set(result["machine"])
    assert result["machine"]["threads"] == 1
    assert [(r["seed"], r["model"]) for r in result["rows"]] == [(0, "lowrank"), (0, "dense")]
    low = result["rows"][0]
    assert low["rank"] == 1 and low["linear_params"] == 6912 and low["format"] == "lowrank"
    assert 0 <= low["test"]["accuracy"] <= 1 and 0 <= low["val"]["accuracy"] <= 1
    assert "curves" not in low and low["seconds"] > 0  # the committed summary: no curves
    full = json.loads((tmp_path / "out" / "curves" / "formats.json").read_text())
    assert full["rows"][0]["curves"]["train"]  # they live in the git-ignored copy
    assert not result["plan"]["formats"]["btt"]["fits"]  # rank 1 is over 50x: not trained
    table = (tmp_path / "out" / "formats.md").read_text()
    assert "| btt | - | 41216 | 9.6x | not trained: rank 1 is 9.6x, short of 50x |" in table
    assert "| lowrank | 1 | 6912 | 57.2x |" in table and "| majority class |" in table
    # --append resumes: the (seed, model) pairs done are not trained again
    assert main([*common, "--formats", "lowrank", "--append"]) == 0
    assert len(json.loads((tmp_path / "out" / "formats.json").read_text())["rows"]) == 2


def test_unknown_or_declared_format_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--formats", "einsum", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "--formats einsum" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
