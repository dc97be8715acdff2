"""The main job's summary (``make run``: DLRM dense vs CoMERA) says what CoMERA buys (issue 42,
item 10): every row's peak memory of a training step, and the same step at larger tables, where
the dense step grows with the rows and the TT step does not. Each number is checked against the
quantity its label names, on a tiny DLRM."""

from __future__ import annotations

import copy
import statistics
from dataclasses import replace

import pytest
import torch

import comera
from comera.experiments.dlrm_task import SCALE_FACTORS, SCALE_STEPS, DLRMTask, DLRMTaskConfig
from comera.experiments.engine import EngineConfig
from comera.experiments.results import at_scale_table, run_experiment, summary_table
from comera.experiments.step_cost import probe_step

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = DLRMTaskConfig(cardinalities=(3000, 2000, 50, 4000), max_rows=400, n_train=2048,
                      n_val=512, n_test=512, embedding_dim=8, bottom_mlp=(16, 8),
                      top_mlp=(16, 1), tt_ranks=4, tt_min_rows=100, tt_cache_rows=8)
ENGINE = EngineConfig(steps_early=6, steps_late=4, batch_size=64, lam=0.005,
                      target_compression=3.0, eval_every=5, threads=1)
FLOAT = 4  # bytes


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    return run_experiment(DLRMTask(TINY), ENGINE, tmp_path_factory.mktemp("dlrm"))


def test_every_row_has_the_peak_memory_of_its_training_step(summary):
    """At least what the step must hold at once: every parameter with its gradient and AdamW's
    two moments (16 bytes a parameter); the TT rows hold far less than the dense one."""
    rows = {row["stage"]: row for row in summary["rows"]}
    assert set(rows) == {"dense", "early", "late"}
    for row in rows.values():
        stored = row["sizes"]["parameters"]  # every stored parameter of that model
        assert row["peak_bytes"] >= 4 * FLOAT * stored, (row["name"], row["peak_bytes"], stored)
    # the late model is stored at the ranks the early stage left (pruning is a mask until then)
    assert rows["late"]["peak_bytes"] <= rows["early"]["peak_bytes"] < rows["dense"]["peak_bytes"]
    table = summary_table(summary)
    assert "| peak MiB |" in table
    dense_mib = f"{rows['dense']['peak_bytes'] / 2**20:,.1f}"
    assert f"| dense | {rows['dense']['ms_per_step']:.1f} | 1.00x | {dense_mib} |" in table


def test_the_step_at_larger_tables_grows_for_dense_tables_only(summary):
    scale = summary["at_scale"]
    rungs = scale["rungs"]
    assert [r["max_rows"] for r in rungs] == [TINY.max_rows * f for f in SCALE_FACTORS]
    for r in rungs:  # the capped sizes of the Kaggle-shaped tables, dense and TT alike
        sizes = [min(c, r["max_rows"]) for c in TINY.cardinalities]
        assert r["table_rows"] == sum(sizes)
        assert r["dense"]["table_parameters"] == sum(sizes) * TINY.embedding_dim
        assert r["tt"]["table_parameters"] < r["dense"]["table_parameters"]
        # the dense tables, their gradients and AdamW's two moments are all held at the peak
        assert r["dense"]["peak_bytes"] >= 4 * FLOAT * r["dense"]["table_parameters"]
        assert len(r["dense"]["step_ms"]) == len(r["tt"]["step_ms"]) == SCALE_STEPS
        assert r["dense"]["ms"] == statistics.median(r["dense"]["step_ms"])
    dense_peaks = [r["dense"]["peak_bytes"] for r in rungs]
    tt_peaks = [r["tt"]["peak_bytes"] for r in rungs]
    assert dense_peaks == sorted(dense_peaks) and dense_peaks[-1] > 5 * dense_peaks[0]
    assert tt_peaks[-1] < 2 * tt_peaks[0]  # the TT tables' size barely moves with the rows
    assert scale["kaggle_dense_table_bytes"] == sum(comera.data.criteo.CRITEO_KAGGLE_CARDINALITIES
                                                    ) * TINY.embedding_dim * FLOAT
    table = summary_table(summary)
    assert at_scale_table(scale) in table
    for r in rungs:
        assert (f"| {r['max_rows']:,} | {r['table_rows']:,} | {r['dense']['ms']:,.1f} | "
                f"{r['tt']['ms']:,.1f} | {r['dense']['ms'] / r['tt']['ms']:.2f}x |") in table


def test_the_verdict_names_the_size_from_which_tt_stays_faster(summary):
    scale = summary["at_scale"]

    def timed(*pairs):
        rungs = [copy.deepcopy(r) for r in scale["rungs"]]
        for rung, (dense, tt) in zip(rungs, pairs, strict=True):
            rung["dense"]["ms"], rung["tt"]["ms"] = dense, tt
        faster = None
        for rung in reversed(rungs):
            if rung["tt"]["ms"] >= rung["dense"]["ms"]:
                break
            faster = rung["max_rows"]
        return at_scale_table({**scale, "rungs": rungs, "tt_faster_from": faster})

    caps = [r["max_rows"] for r in scale["rungs"]]
    assert f"faster than dense ones from {caps[1]:,} rows" in timed((1, 2), (3, 2), (9, 2))
    assert "slower at every size measured" in timed((1, 2), (1, 2), (1, 2))
    assert "1.6 GB" not in timed((1, 2), (3, 2), (9, 2))  # dim 8: 33.76M rows are 1.08 GB
    assert "1.08 GB as dense fp32 tables" in timed((1, 2), (3, 2), (9, 2))


def test_an_uncapped_or_real_data_task_adds_no_scale_rows():
    task = DLRMTask.__new__(DLRMTask)
    task.cfg = replace(TINY, max_rows=None)
    assert task.at_scale(ENGINE) is None
    task.cfg = replace(TINY, tsv_path="clicks.tsv")
    assert task.at_scale(ENGINE) is None


def test_probing_a_trained_model_keeps_its_function():
    """The probe steps at learning rate 0: the optimizer allocates its state and computes every
    update, and the model computes what it did."""
    task = DLRMTask(TINY)
    model = task.build_model("tt")
    batch = task.batch(torch.arange(64))
    before = model(batch[0], batch[1]).detach()
    cost = probe_step(model, lambda m: task.loss(m, batch), ENGINE, inputs=batch)
    torch.testing.assert_close(model(batch[0], batch[1]).detach(), before, rtol=0, atol=0)
    assert cost.peak_bytes > cost.resident_bytes > 0 and len(cost.step_ms) == 2
