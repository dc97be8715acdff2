"""The harness's methods on a toy study: each is the engine's run of the model it names, and
the rows are bit for bit those of the hand-written protocol the studies ran before the harness
(seed, build, the same trainer and batches), so moving a study onto the engine changes no
result."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

import comera
from benchmarks.studies.harness.methods import (
    ENGINE_KIND,
    Study,
    engine_kind,
    kind_title,
    method_names,
    narrow_sizes,
)
from comera.experiments.engine import EngineConfig
from comera.experiments.task import IndexStream, model_format
from comera.models.transformer import linear_layer
from comera.ranks.truncate import round_
from tests.helpers.toy_task import ToyTask

CFG = EngineConfig(batch_size=16, lr=1e-2, lr_gates=0.1, warmup=2, eval_every=3, threads=1,
                   max_grad_norm=1.0, late_allocation="prune")


class ToyStudy(ToyTask):
    """The toy task with what a study's task offers: models of any kind at a rank, and the
    layers compression speaks of."""

    def build(self, format: str = "dense", rank: int | None = None, **sizes):
        first = linear_layer(model_format(format), 32, 32, rank or 6, ((4, 8), (8, 4)), d=2)
        return nn.Sequential(first, nn.Tanh(), nn.Linear(32, 4)).double()

    @staticmethod
    def block_linears(model):
        return [("0", model[0])]


pytestmark = pytest.mark.usefixtures("one_thread")


def _study(tmp_path, **kw) -> Study:
    return Study(ToyStudy(), CFG, tmp_path / "work", steps=8, early=5, decide=3, lam=5.0,
                 max_rank=6, **kw)


def _by_hand(task, model, trainer, seed, first, steps, warmup, base):
    """The protocol of the scripts before the harness: their own loop."""
    stream = IndexStream(task.train_size(), CFG.batch_size, seed)
    model.train()
    for step in range(first, first + steps):
        factor = min(1.0, (step + 1) / warmup) if warmup else 1.0
        for group in trainer.optimizer.param_groups:
            group["lr"] = base[group.get("name", "other")] * factor
        trainer.step(task.loss(model, task.step_batch(stream, step)))
    model.eval()
    with torch.no_grad():
        return task.evaluate(model, "val"), task.evaluate(model, "test")


def _tt_trainer(model, lam):
    return comera.CoMERATrainer(model, comera.make_optimizer(
        model, comera.OptimizerConfig(CFG.lr, CFG.lr_gates, CFG.lr)), lam, max_grad_norm=1.0)


BASE = {"cores": CFG.lr, "gates": CFG.lr_gates, "other": CFG.lr}


def test_dense_and_a_format_at_its_uniform_rank_equal_the_loop_of_before(tmp_path):
    study = _study(tmp_path)
    task = study.task
    dense = study.dense(seed=1, lr=CFG.lr)
    torch.manual_seed(1)
    model = task.build("dense")
    opt = torch.optim.AdamW([{"params": list(model.parameters()), "lr": CFG.lr,
                              "name": "other"}], weight_decay=0.0)
    val, test = _by_hand(task, model, comera.DenseTrainer(model, opt, 1.0), 1, 0, 8, 2, BASE)
    assert dense["val"] == val and dense["test"] == test
    assert dense["method"] == "dense" and dense["compression"] == 1.0
    row = study.fixed("tt", 3.0, seed=1, lr=CFG.lr)
    def size(rank):  # the layer itself, counted
        return task.build("tt", rank)[0].num_parameters()

    assert size(row["rank"]) == row["linear_params"] <= 1056 / 3 < size(row["rank"] + 1)
    torch.manual_seed(1)
    model = task.build("tt", row["rank"])
    val, test = _by_hand(task, model, _tt_trainer(model, 0.0), 1, 0, 8, 2, BASE)
    assert row["val"] == val and row["test"] == test and row["compression"] >= 3.0


def _assert_comera_by_hand(task, rows, fmt: str, rank: int) -> None:
    """The rows' early and late scores are CoMERA's by hand: ``fmt`` at ``rank``, 5 early steps
    (lam 5), exact rounding, then 3 late steps to 3x."""
    torch.manual_seed(0)
    early = task.build(fmt, rank)
    val, _ = _by_hand(task, early, _tt_trainer(early, 5.0), 0, 0, 5, 2, BASE)
    assert rows[0]["val"] == val
    round_(early)
    model = copy.deepcopy(early)
    trainer = _tt_trainer(model, 0.0)
    trainer.start_late_stage(comera.LateStage.for_compression(model, 3.0, steps=3))
    val, test = _by_hand(task, model, trainer, 0, 5, 3, 1, BASE)
    assert rows[1]["val"] == val and rows[1]["test"] == test


def test_comera_early_then_late_equals_the_loop_of_before(tmp_path):
    study = _study(tmp_path)
    task = study.task
    rows = study.comera([3.0], seed=0, lr=CFG.lr)
    assert [r["method"] for r in rows] == ["comera early", "comera"]
    _assert_comera_by_hand(task, rows, "tt", 6)
    assert rows[1]["compression"] >= 3.0 * 0.9 and rows[1]["steps"] == 8


def test_every_method_gives_rows_with_curves_and_clocks(tmp_path):
    study = _study(tmp_path)
    assert {"dense", "narrow", "comera", "spectrum", "early", "tt", "lowrank"} <= set(
        method_names()) and "einsum" not in method_names()
    for method in ("spectrum", "early", "lowrank", "tucker"):
        rows = study.method(method, [2.0], seed=0, lr=CFG.lr)
        assert rows, method
        for r in rows:
            assert r["target"] == 2.0 and r["seconds"] > 0 and r["steps"] == 8, method
            steps = [s for s, _ in r["curves"]["train"]]
            assert steps == list(range(8))
            val = r["curves"]["val"]
            assert [s for s, _, _ in val] == [0, 3, 6, 8] and "loss" in val[-1][2]
            assert [t for _, t, _ in val] == sorted(t for _, t, _ in val)
    with pytest.raises(comera.ConfigError, match="method 'bogus'; choose"):
        study.method("bogus", [2.0], 0, CFG.lr)
    assert study.fixed("tt", 1000.0, 0, CFG.lr) is None  # rank 1 over the budget: no row


def test_a_cut_off_study_resumes_its_models(tmp_path):
    first = _study(tmp_path).dense(seed=0, lr=CFG.lr)
    again = replace(_study(tmp_path), resume=True).dense(seed=0, lr=CFG.lr)
    assert again["val"] == first["val"] and again["curves"] == first["curves"]


def test_the_narrower_dense_model_fills_the_budget(tmp_path):
    from comera.experiments.lm_task import LMTask, LMTaskConfig
    from tests.helpers.tiny_corpus import write_tiny_corpus

    write_tiny_corpus(tmp_path / "lib")
    task = LMTask(LMTaskConfig(seq_len=16, vocab_size=64, d_model=32, n_heads=2, d_ff=64,
                               n_layers=2), root=tmp_path / "lib", use_cache=False)
    dense = sum(m.weight.numel() for _, m in task.block_linears(task.build()))
    for target in (2.0, 4.0, 8.0):
        sizes = narrow_sizes(task, dense / target)
        assert sizes["d_model"] % 2 == 0 and sizes["d_model"] < 32
        model = task.build("dense", **sizes)
        params = sum(m.weight.numel() for _, m in task.block_linears(model))
        assert params <= dense / target < params + 2 * sizes["d_model"] * 2  # one d_ff more
    with pytest.raises(comera.ConfigError, match="narrowest"):
        narrow_sizes(task, 10.0)


# -- CoMERA on any format ----------------------------------------------------------------------
class ToyBTTStudy(ToyStudy):
    """The toy study with modes BTT compresses at several ranks: (8, 4) -> (4, 8), one bond
    capped at 8; 256 r + 32 parameters against dense's 1056 (rank 3 the largest below)."""

    def build(self, format: str = "dense", rank: int | None = None, **sizes):
        first = linear_layer(model_format(format), 32, 32, rank or 6, ((8, 4), (4, 8)), d=2)
        return nn.Sequential(first, nn.Tanh(), nn.Linear(32, 4)).double()

    def build_model(self, format: str = "tt"):  # what the engine checks a target against
        return self.build(format, 1)


def _btt_study(tmp_path, **kw) -> Study:
    return Study(ToyBTTStudy(), CFG, tmp_path / "work", steps=8, early=5, decide=3, lam=5.0,
                 max_rank=6, **kw)


def test_comera_on_btt_starts_where_it_compresses_and_lands_on_the_target(tmp_path):
    study = _btt_study(tmp_path)
    task = study.task

    def size(rank):
        return task.build("btt", rank)[0].num_parameters()

    assert study.start_rank("btt") == 3 and size(3) < 1056 <= size(4)  # max_rank 6: too big
    rows = study.method("comera@btt", [3.0], seed=0, lr=CFG.lr)
    assert [r["method"] for r in rows] == ["comera@btt early", "comera@btt"]
    assert all(r["format"] == "btt" and r["start_rank"] == 3 and r["exact_rounding"]
               for r in rows)
    # the engine's run is CoMERA on BTT by hand: early stage, exact rounding, late stage
    _assert_comera_by_hand(task, rows, "btt", 3)
    assert rows[1]["compression"] >= 3.0 and rows[1]["steps"] == 8  # on the target
    assert rows[0]["compression"] < 3.0  # from a larger model: the late stage pruned
    checkpoints = {f.name for f in (tmp_path / "work" / "checkpoints").iterdir()}
    assert {"comera@btt-r3-early-s0-lr0.01.pt", "comera@btt-r3-3x-s0-lr0.01.pt"} <= checkpoints
    fixed = study.method("btt", [3.0], seed=0, lr=CFG.lr)[0]  # its fixed-rank rival
    assert fixed["rank"] == 1 and fixed["compression"] >= 3.0


def test_comera_start_sets_the_early_models_compression(tmp_path):
    assert _btt_study(tmp_path, comera_start=1.5).start_rank("btt") == 2  # 1.94x; rank 3 1.32x
    assert _btt_study(tmp_path, comera_start=1.5).start_rank("tt") <= 6
    with pytest.raises(comera.ConfigError, match="not even rank 1 of the btt model compresses"
                                                 " 5x"):
        _btt_study(tmp_path, comera_start=5.0).start_rank("btt")
    for bad in (1.0, 0.5, "2"):
        with pytest.raises(comera.ConfigError, match="comera_start="):
            _btt_study(tmp_path, comera_start=bad)


def test_comera_on_tt_is_the_comera_method_where_max_rank_compresses(tmp_path):
    plain = _study(tmp_path).comera([3.0], seed=0, lr=CFG.lr)
    on_tt = _study(tmp_path).method("comera@tt", [3.0], seed=0, lr=CFG.lr)
    assert [r["val"] for r in plain] == [r["val"] for r in on_tt]
    assert "format" not in plain[1] and on_tt[1]["format"] == "tt"  # the rows of before
    checkpoints = {f.name for f in (tmp_path / "work" / "checkpoints").iterdir()}
    assert {"comera-early-s0-lr0.01.pt", "comera@tt-r6-early-s0-lr0.01.pt"} <= checkpoints


@pytest.mark.parametrize(("name", "match"), [
    ("comera@bogus", "'bogus' is not a registered format; CoMERA trains rank-adaptively on "
                     "tt, ttm, .*btt"),
    ("comera@dense", "dense layers have no ranks to prune"),
    ("comera@einsum", "the einsum format builds no layer"),
    ("btt@tt", "only comera takes a format after '@'"),
    ("comera@btt:heavy", "parametrization='heavy'"),
    ("narrow:plain", "narrow takes no parametrization"),
    ("bogus", "method 'bogus'; choose dense, narrow, comera"),
])
def test_a_method_that_cannot_run_is_refused_before_any_training(tmp_path, name, match):
    study = _btt_study(tmp_path)
    with pytest.raises(comera.ConfigError, match=match):
        study.method(name, [3.0], 0, CFG.lr)
    assert not (tmp_path / "work").exists()


def test_comera_on_a_format_is_refused_what_its_late_stage_cannot_do(tmp_path):
    spectral = replace(_btt_study(tmp_path), config=replace(CFG, late_allocation="spectrum"))
    with pytest.raises(comera.ConfigError, match=r"late_allocation='spectrum'.*tensor-train "
                                                 r"chains"):
        spectral.method("comera@btt", [3.0], 0, CFG.lr)
    with pytest.raises(comera.ConfigError, match="at 5x: the btt model's block layers at rank "
                                                 "1"):
        _btt_study(tmp_path).method("comera@btt", [5.0], 0, CFG.lr)  # rank 1 is 3.7x
    assert not (tmp_path / "work").exists()
    assert {"comera@btt", "comera@btt:balanced", "comera@lowrank"} <= set(method_names())
    assert not any(m.startswith(("comera@dense", "comera@einsum")) for m in method_names())


# -- the dense frontier at given widths ---------------------------------------------------------
def _lm_task(tmp_path):
    from comera.experiments.lm_task import LMTask, LMTaskConfig
    from tests.helpers.tiny_corpus import write_tiny_corpus

    write_tiny_corpus(tmp_path / "lib")
    return LMTask(LMTaskConfig(seq_len=16, vocab_size=64, d_model=32, n_heads=2, d_ff=64,
                               n_layers=1, eval_limit=8), root=tmp_path / "lib",
                  use_cache=False)


def test_narrow_at_given_widths_trains_dense_at_each(tmp_path):
    task = _lm_task(tmp_path)
    study = Study(task, CFG, tmp_path / "work", steps=2, widths=(16, 24))
    assert study.width_sizes(16) == {"d_model": 16, "d_ff": 32}  # the FFN at the task's 2x
    assert study.runs_of("narrow", [8.0]) == [("dense@16", None), ("dense@24", None)]
    rows = study.method("narrow", [8.0], seed=0, lr=CFG.lr)
    assert [(r["method"], r["target"], r["d_model"], r["d_ff"]) for r in rows] == [
        ("dense@16", None, 16, 32), ("dense@24", None, 24, 48)]
    dense = 4 * 32 * 32 + 2 * 32 * 64
    for r, d in zip(rows, (16, 24), strict=True):
        assert r["linear_params"] == 4 * d * d + 2 * d * 2 * d  # no biases in the LM's blocks
        assert r["compression"] == dense / r["linear_params"] and r["steps"] == 2
    assert Study(task, CFG, tmp_path, steps=2).runs_of("narrow", [8.0]) == [("narrow", 8.0)]


@pytest.mark.parametrize(("width", "match"), [(15, "multiple of the 2 heads"),
                                              (0, "multiple of the 2 heads"),
                                              (32, "the task's own d_model")])
def test_a_width_the_model_cannot_take_is_refused(tmp_path, width, match):
    with pytest.raises(comera.ConfigError, match=match):
        Study(_lm_task(tmp_path), CFG, tmp_path / "work", steps=2, widths=(16, width))


def test_cola_is_a_method_the_harness_builds_for_the_lm_task_only(tmp_path):
    """CoLA is a layer kind, not a format: a method at each parametrization, run by the engine
    as a lowrank run, built by the harness, which refuses a task other than the causal LM."""
    assert {"cola", "cola:balanced", "cola:plain"} <= set(method_names())
    assert "comera@cola" not in method_names()  # no format: CoMERA's methods take formats
    assert (engine_kind("cola"), engine_kind("btt")) == (ENGINE_KIND, "btt")
    assert (kind_title("cola"), kind_title("ttm")) == ("CoLA (B silu(A x))", "TT-matrix")
    with pytest.raises(comera.ConfigError, match="method 'cola' runs on the causal LM task"):
        _study(tmp_path).method("cola", [2.0], seed=0, lr=CFG.lr)
