"""The formats-accuracy script: each format's model hits the size budget, is initialised as the
fixed-rank TT model is, and a smoke run writes a well-formed results file."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from benchmarks.studies.accuracy_frontier import SmallReviews, linear_sizes
from benchmarks.studies.formats_accuracy import (
    build_model,
    encoder_shapes,
    main,
    plan,
    trained_formats,
)
from comera.experiments.transformer_task import ReviewsTaskConfig
from comera.layers.linear import GatedLinear
from comera.models import PairClassifier
from comera.ranks.budget import linear_size


@pytest.fixture(scope="module")
def task():
    return SmallReviews(ReviewsTaskConfig(max_len=64))


def test_every_format_but_the_declared_one_is_trained():
    assert "einsum" not in trained_formats()
    assert {"tt", "ttm", "tucker", "cp", "lowrank", "tr", "btt"} <= set(trained_formats())


def test_each_model_hits_the_budget_at_the_largest_rank(task):
    the_plan = plan(task, trained_formats(), 50.0)
    shapes = [(i, o, True) for _, i, o in encoder_shapes(task)]
    assert len(shapes) == 12  # q, k, v, o, ffn_in, ffn_out in 2 blocks
    budget = the_plan["budget"]
    assert budget == pytest.approx(the_plan["dense_linear"] / 50)
    for fmt, p in the_plan["formats"].items():
        if not p["fits"]:  # reported with its rank-1 size, which is over the budget
            assert p["linear_params"] == linear_size(fmt, shapes, 1) > budget, fmt
            continue
        model = build_model(task, fmt, p["rank"], seed=0)
        layers = [m for n, m in model.named_modules() if isinstance(m, GatedLinear)]
        assert len(layers) == 12 and all(m.format.name == fmt for m in layers), fmt
        params, dense = linear_sizes(model)  # what the results rows report, from the layers
        assert params == p["linear_params"] <= budget, fmt
        larger = linear_size(fmt, shapes, p["rank"] + 1)
        assert larger > budget or larger == linear_size(fmt, shapes, 512), fmt  # or capped
        assert dense == the_plan["dense_linear"]
        assert p["compression"] == pytest.approx(dense / params)


def test_tt_model_is_the_fixed_rank_model(task):
    rank = plan(task, ["tt"], 50.0)["formats"]["tt"]["rank"]
    ours = build_model(task, "tt", rank, seed=3)
    torch.manual_seed(3)
    fixed = PairClassifier(replace(task.model_config(True), rank=rank))
    a, b = ours.state_dict(), fixed.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    cp = build_model(task, "cp", 2, seed=3)
    assert {type(m).__name__ for n, m in cp.named_modules() if n.endswith(".q")} == {
        "GatedLinear"}
    ffn = [m for n, m in cp.named_modules() if n.endswith(".ffn_in")]
    assert ffn and all(m.format.name == "cp" for m in ffn)


def test_smoke_run_writes_rows_and_the_table(tmp_path, capsys):
    assert main(["--smoke", "--seeds", "0", "--formats", "lowrank", "btt", "--out",
                 str(tmp_path)]) == 0
    result = json.loads((tmp_path / "formats.json").read_text())
    assert {"torch", "cpu", "threads"} <= set(result["machine"])
    assert result["machine"]["threads"] == 1
    assert [(r["seed"], r["model"]) for r in result["rows"]] == [(0, "lowrank"), (0, "dense")]
    low = result["rows"][0]
    assert low["rank"] == 1 and low["linear_params"] == 6912
    assert 0 <= low["test"]["accuracy"] <= 1 and 0 <= low["val"]["accuracy"] <= 1
    assert not result["plan"]["formats"]["btt"]["fits"]  # rank 1 is over 50x: not trained
    table = (tmp_path / "formats.md").read_text()
    assert "| btt | - | 41216 | 9.6x | not trained: rank 1 is 9.6x, short of 50x |" in table
    assert "| lowrank | 1 | 6912 | 57.2x |" in table and "| majority class |" in table
    # --append resumes: the (seed, model) pairs done are not trained again
    assert main(["--smoke", "--seeds", "0", "--formats", "lowrank", "--append", "--out",
                 str(tmp_path)]) == 0
    assert len(json.loads((tmp_path / "formats.json").read_text())["rows"]) == 2


def test_unknown_or_declared_format_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--formats", "einsum", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "--formats einsum" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
