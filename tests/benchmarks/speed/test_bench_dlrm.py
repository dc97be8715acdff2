"""The DLRM training-step benchmark on capped tables (2,000 rows each, batch 64, one repeat).

Checks the JSON schema and finite numbers, the parameter counts and resident bytes against hand
sums (the reference DLRM's layer widths, AdamW's two moments and step counter per tensor, the
input batch), that every timed, warm-up and measured step really went through the trainer, that
the TT variant holds TT tables exactly where the table cap puts them, and the errors for bad
settings.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

import comera
from benchmarks.lib.measure import num_threads
from benchmarks.speed.bench_dlrm import (
    BenchConfig,
    build_variant,
    main,
    make_batch,
    measure_memory,
    render_markdown,
    run_benchmark,
)
from comera.data.criteo import CRITEO_KAGGLE_CARDINALITIES
from comera.errors import ConfigError
from comera.layers.cached_embedding import CachedTTEmbedding

ROWS, BATCH, DIM, TABLES, DENSE_FEATURES = 2000, 64, 16, 26, 13
PAIRS = (TABLES + 1) * TABLES // 2  # interactions among the bottom output and the 26 tables


def capped_rows() -> list[int]:
    return [min(c, ROWS) for c in CRITEO_KAGGLE_CARDINALITIES]


def mlp_params(widths: list[int]) -> int:
    return sum(a * b + b for a, b in itertools.pairwise(widths))


def dense_param_count() -> int:
    """The reference Kaggle DLRM by hand: 13-512-256-64-16, tables x 16, 367-512-256-1."""
    return (mlp_params([DENSE_FEATURES, 512, 256, 64, 16]) + sum(capped_rows()) * DIM
            + mlp_params([DIM + PAIRS, 512, 256, 1]))


def input_bytes(batch: int) -> int:
    return batch * (4 * DENSE_FEATURES + 8 * TABLES + 4)  # float32 dense, int64 ids, labels


BUFFER_BYTES = 8 * (2 * PAIRS + TABLES)  # int64 pair rows and columns, table sizes


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with num_threads(1):
        yield


@pytest.fixture(scope="module")
def bench() -> BenchConfig:
    return BenchConfig(batch=BATCH, repeats=1, warmup=1, max_rows=ROWS)


@pytest.fixture(scope="module")
def payload(_one_thread, bench):
    return run_benchmark(bench)


def test_payload_schema(payload):
    assert set(payload) == {"machine", "load", "model", "bench", "batch", "variants",
                            "memory_counted", "ms", "memory", "paper", "dense_over_tt",
                            "dense_over_tt_cache"}
    assert {"torch", "cpu", "threads", "commit", "date"} <= set(payload["machine"])
    assert payload["machine"]["threads"] == 1
    for when in ("before", "after"):
        assert len(payload["load"][when]["load_average"]) == 3
    assert payload["model"]["max_rows"] == ROWS and payload["model"]["tt_ranks"] == 32
    assert payload["batch"]["size"] == BATCH
    assert len(payload["batch"]["unique_ids_per_table"]) == TABLES
    assert set(payload["ms"]) == set(payload["memory"]) == set(payload["variants"])
    assert set(payload["ms"]) == {"dense", "tt", "tt_cache"}
    for m in payload["memory"].values():
        assert set(m) == {"resident_bytes", "peak_extra_bytes", "grads_bytes",
                          "activations_and_temporaries_bytes", "peak_total_bytes"}
        assert set(m["resident_bytes"]) == {"params", "buffers", "grads", "optimizer_state",
                                            "inputs", "total"}
    assert payload["paper"] == {"compression": 99.0, "peak_memory_reduction": 7.0}
    parsed = json.loads(json.dumps(payload, allow_nan=False))  # serialisable, finite
    assert parsed["model"]["cardinalities"] == list(CRITEO_KAGGLE_CARDINALITIES)
    text = render_markdown(payload)
    assert "| dense |" in text and "| tt |" in text and "capped at 2,000" in text
    assert "367-512-256-1" in text


def test_numbers_are_finite_and_ratios_follow_them(payload, bench):
    ms, mem = payload["ms"], payload["memory"]
    for name in ("dense", "tt"):
        assert math.isfinite(ms[name]) and ms[name] > 0, name
        m = mem[name]
        assert m["peak_extra_bytes"] > m["grads_bytes"] > 0, name
        assert m["resident_bytes"]["grads"] == 0, name  # cleared before the measured step
        assert m["peak_total_bytes"] == m["resident_bytes"]["total"] + m["peak_extra_bytes"]
        # warm-up, timed repeats and the two steps of the memory measurement, all applied
        assert payload["variants"][name]["steps_run"] == bench.warmup + bench.repeats + 2
    r = payload["dense_over_tt"]
    assert r["time"] == pytest.approx(ms["dense"] / ms["tt"])
    assert r["peak_memory"] == pytest.approx(mem["dense"]["peak_total_bytes"]
                                             / mem["tt"]["peak_total_bytes"])
    assert 0 < r["time"] < math.inf and r["peak_memory"] > 1  # TT tables hold fewer bytes
    unique = payload["batch"]["unique_ids_per_table"]
    assert all(1 <= u <= min(BATCH, rows) for u, rows in zip(unique, capped_rows(),
                                                               strict=True))


def test_dense_counts_and_resident_bytes_equal_a_hand_sum(payload):
    n = dense_param_count()
    info, res = payload["variants"]["dense"], payload["memory"]["dense"]["resident_bytes"]
    assert info["params"] == info["effective_size"] == n
    assert info["table_params"] == info["dense_table_params"] == sum(capped_rows()) * DIM
    assert info["tt_tables"] == 0 and info["table_compression"] == 1.0
    tensors = 2 * (4 + 3) + TABLES  # weight + bias per linear layer, one weight per table
    assert res["params"] == 4 * n
    assert res["optimizer_state"] == 2 * 4 * n + 4 * tensors  # exp_avg, exp_avg_sq, fp32 step
    assert res["buffers"] == BUFFER_BYTES
    assert res["inputs"] == input_bytes(BATCH)
    assert res["total"] == 3 * 4 * n + 4 * tensors + BUFFER_BYTES + input_bytes(BATCH)
    assert payload["memory"]["dense"]["grads_bytes"] == 4 * n


def test_tt_counts_and_resident_bytes_equal_a_hand_sum(payload, bench):
    info, res = payload["variants"]["tt"], payload["memory"]["tt"]["resident_bytes"]
    big = [rows for rows in capped_rows() if rows >= ROWS]  # every capped table is TT
    assert info["tt_tables"] == len(big) == 14
    # every capped table: 2,000 rows -> modes (10, 10, 20) x (2, 2, 4), bonds (1, 20, 32, 1)
    assert info["largest_tt_table"] == {"rows": ROWS, "row_modes": [10, 10, 20],
                                        "col_modes": [2, 2, 4], "bonds": [1, 20, 32, 1]}
    cores = 1 * 10 * 2 * 20 + 20 * 10 * 2 * 32 + 32 * 20 * 4 * 1
    gates = 20 + 32
    small = sum(rows for rows in capped_rows() if rows < ROWS) * DIM
    mlps = dense_param_count() - sum(capped_rows()) * DIM
    n = mlps + small + len(big) * (cores + gates)
    assert info["params"] == n
    assert info["effective_size"] == mlps + small + len(big) * cores  # gates all open, folded
    assert info["table_params"] == small + len(big) * cores
    assert info["dense_table_params"] == sum(capped_rows()) * DIM
    assert info["tt_table_compression"] == pytest.approx(ROWS * DIM / cores)
    tensors = 2 * (4 + 3) + (TABLES - len(big)) + len(big) * (3 + 2)  # 3 cores, 2 gates each
    assert res["params"] == 4 * n
    assert res["optimizer_state"] == 2 * 4 * n + 4 * tensors
    assert res["buffers"] == BUFFER_BYTES
    assert res["total"] == 3 * 4 * n + 4 * tensors + BUFFER_BYTES + input_bytes(BATCH)
    assert payload["dense_over_tt"]["params"] == pytest.approx(
        dense_param_count() / info["effective_size"])


def test_tt_cache_variant_caches_hot_rows_and_counts_them(payload, bench):
    """tt_cache is tt with CachedTTEmbedding tables: the cached rows count in the table size,
    and the hot ids answer a share of the sample's lookups."""
    tt, cached = payload["variants"]["tt"], payload["variants"]["tt_cache"]
    assert cached["tt_tables"] == tt["tt_tables"] > 0
    rows = min(bench.cache_rows, ROWS)
    assert cached["table_params"] == tt["table_params"] + tt["tt_tables"] * rows * DIM
    shares = cached["cache_hit_percent_per_table"]
    assert len(shares) == tt["tt_tables"] and all(0 < p <= 100 for p in shares)
    variant = build_variant("tt_cache", bench)
    tables = [t for t in variant.model.embeddings if isinstance(t, CachedTTEmbedding)]
    assert len(tables) == tt["tt_tables"] and all(t.cache_rows == rows for t in tables)
    assert "Dense / TT with the hot-row cache" in render_markdown(payload)


def test_variants_are_the_engine_settings(bench):
    dense, tt = build_variant("dense", bench), build_variant("tt", bench)
    assert type(dense.trainer) is comera.DenseTrainer
    assert isinstance(tt.trainer, comera.CoMERATrainer) and tt.trainer.lam > 0
    assert tt.trainer.stage == "early"
    assert [g["name"] for g in tt.optimizer.param_groups] == ["cores", "gates", "other"]
    # same seed, same MLP weights: the variants differ only in their tables
    for a, b in zip(dense.model.bottom.parameters(), tt.model.bottom.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    batch = make_batch(bench.model_config("dense"), 8)
    assert batch.sparse.dtype == torch.int64 and batch.sparse.shape == (8, TABLES)
    sizes = torch.tensor(capped_rows())
    assert bool(((batch.sparse >= 0) & (batch.sparse < sizes)).all())
    assert bool(((batch.labels == 0) | (batch.labels == 1)).all())
    before = [p.detach().clone() for p in tt.model.parameters()]
    mem = measure_memory(tt, batch)  # two full steps: every parameter moves
    assert mem["resident_bytes"]["inputs"] == input_bytes(8)
    moved = [not torch.equal(a, b) for a, b in zip(before, tt.model.parameters(), strict=True)]
    assert all(moved)


def test_bad_settings_raise_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="nope"):
        BenchConfig(variants=("nope",))
    with pytest.raises(ConfigError, match="batch=0"):
        BenchConfig(batch=0)
    with pytest.raises(ConfigError, match="repeats"):
        BenchConfig(repeats=0)
    with pytest.raises(ConfigError, match="max_rows"):
        BenchConfig(max_rows=0)
    with pytest.raises(ConfigError, match="leaves no TT table"):
        BenchConfig(max_rows=500, tt_min_rows=1000)
    BenchConfig(max_rows=500, tt_min_rows=1000, variants=("dense",))  # no TT model: fine
    with pytest.raises(ConfigError, match="variant 'x'"):
        build_variant("x", BenchConfig())
    with pytest.raises(SystemExit):
        main(["--batch", "0", "--out", str(tmp_path / "x")])
