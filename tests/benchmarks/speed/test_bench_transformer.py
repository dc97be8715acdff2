"""The transformer training-step benchmark on a tiny model (d_model 64, one layer).

Checks the JSON schema, finite times for every variant, the memory accounting against hand sums
of parameter, gradient and optimizer-state bytes, the late-stage truncation against the physical
core sizes, the tensorly-torch layers against their dense reconstruction, and (slow: importing
galore_torch takes about 8 s) that the GaLore variant really runs GaLoreAdamW on low-rank state.
"""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

import comera
from benchmarks.lib.baselines import tt_to_dense
from benchmarks.lib.measure import num_threads, resident_bytes, write_results_to
from benchmarks.lib.memory import rss_available
from benchmarks.lib.model_baselines import GaLoreConfig, TltorchTTLinear, tltorch_transformer
from benchmarks.speed.bench_transformer import (
    BenchConfig,
    build_variant,
    late_stage_cap,
    main,
    make_batch,
    measure_memory,
    model_args,
    peak_in_this_process,
    render_markdown,
    run_benchmark,
    smoke_config,
    tt_layer_compression,
)
from comera.errors import ConfigError
from comera.models.transformer import TransformerConfig

FAST_VARIANTS = ("dense", "comera_early", "comera_late", "tltorch_tt", "tltorch_blocktt")
VOCAB, D, FF, SEQ = 1000, 64, 256, 16


def tiny_config() -> TransformerConfig:
    """The script's --smoke model: one block, d_model 64, two modes per side."""
    return smoke_config()


def dense_param_count() -> int:
    """The dense PairClassifier by hand: embeddings, LayerNorms, one block, the head."""
    emb = VOCAB * D + SEQ * D + 2 * D + 2 * D
    block = 4 * (D * D + D) + (D * FF + FF) + (FF * D + D) + 2 * 2 * D
    return emb + block + D * 3 + 3


def input_bytes(batch: int) -> int:
    return 8 * (2 * batch * SEQ + batch)  # int64 ids and segments (B, S), labels (B,)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with num_threads(1):
        yield


@pytest.fixture(scope="module")
def payload(_one_thread):
    bench = BenchConfig(batches=(1, 2), repeats=1, warmup=1, variants=FAST_VARIANTS,
                        late_compression=60.0)
    return run_benchmark(tiny_config(), bench)


def test_payload_schema(payload):
    assert set(payload) == {"machine", "model", "bench", "variants", "memory_counted",
                            "process_counted", "results", "targets"}
    assert {"torch", "cpu", "threads", "commit", "date"} <= set(payload["machine"])
    assert payload["machine"]["threads"] == 1
    assert payload["model"]["d_model"] == D and payload["model"]["n_layers"] == 1
    assert [r["batch"] for r in payload["results"]] == [1, 2]
    for r in payload["results"]:
        assert r["seq_len"] == SEQ
        assert set(r["ms"]) == set(FAST_VARIANTS) == set(r["memory"])
        assert set(r["speedup_vs_dense"]) == set(FAST_VARIANTS)
        assert r["speedup_vs_dense"]["dense"] == 1.0
        for m in r["memory"].values():
            assert set(m) == {"resident_bytes", "peak_extra_bytes", "grads_bytes",
                              "activations_and_temporaries_bytes", "peak_total_bytes"}
            assert set(m["resident_bytes"]) == {"params", "buffers", "grads",
                                                "optimizer_state", "inputs", "total"}
    assert "comera_vs_galore" not in payload["results"][0]  # no GaLore in this run
    parsed = json.loads(json.dumps(payload))  # serialisable as written
    assert parsed["variants"]["comera_late"]["max_rank"] < 4
    assert "| comera_late |" in render_markdown(payload)


def test_every_variant_has_finite_time_and_memory(payload):
    for r in payload["results"]:
        for name in FAST_VARIANTS:
            assert math.isfinite(r["ms"][name]) and r["ms"][name] > 0, name
            m = r["memory"][name]
            assert m["peak_extra_bytes"] > m["grads_bytes"] > 0, name
            assert m["resident_bytes"]["grads"] == 0, name  # cleared before the measured step
            assert m["resident_bytes"]["inputs"] == input_bytes(r["batch"])
            assert m["peak_total_bytes"] == m["resident_bytes"]["total"] + m["peak_extra_bytes"]


def test_compressed_variants_hold_far_fewer_parameters(payload):
    dense = payload["variants"]["dense"]["params"]
    assert dense == dense_param_count()
    for name in ("comera_early", "tltorch_tt", "tltorch_blocktt"):
        assert payload["variants"][name]["params"] < dense / 10, name
    for r in payload["results"]:  # resident bytes (params + Adam state) follow the counts
        res = {n: m["resident_bytes"] for n, m in r["memory"].items()}
        assert res["comera_early"]["optimizer_state"] < res["dense"]["optimizer_state"] / 10


def test_resident_bytes_of_dense_adamw_equal_a_hand_sum():
    cfg, bench = tiny_config(), BenchConfig(batches=(3,))
    v = build_variant("dense", cfg, bench)
    batch = make_batch(cfg, 3, SEQ)
    v.step(batch)
    n, tensors = dense_param_count(), len(list(v.model.parameters()))
    res = resident_bytes(v.model, v.optimizer, batch.tensors())
    assert res["params"] == 4 * n
    assert res["grads"] == 4 * n
    assert res["optimizer_state"] == 2 * 4 * n + 4 * tensors  # exp_avg, exp_avg_sq, fp32 step
    assert res["buffers"] == 0
    assert res["inputs"] == input_bytes(3)
    assert res["total"] == 4 * n * 4 + 4 * tensors + input_bytes(3)
    mem = measure_memory(v, batch)
    assert mem["grads_bytes"] == 4 * n
    assert mem["resident_bytes"]["total"] == 3 * 4 * n + 4 * tensors + input_bytes(3)


def test_resident_bytes_of_comera_equal_a_hand_sum():
    cfg = tiny_config()
    v = build_variant("comera_early", cfg, BenchConfig())
    batch = make_batch(cfg, 2, SEQ)
    v.step(batch)
    layers = [m for _, m in comera.gated_layers(v.model)]
    tt = sum(c.numel() for m in layers for c in m.cores) + sum(
        g.numel() for m in layers for g in m.gates) + sum(
        m.bias.numel() for m in layers if m.bias is not None)
    other = SEQ * D + 2 * D + 2 * D + 2 * 2 * D + D * 3 + 3  # positions, segments, LNs, head
    n = tt + other
    tensors = len(list(v.model.parameters()))
    res = resident_bytes(v.model, v.optimizer)
    assert (res["params"], res["grads"]) == (4 * n, 4 * n)
    assert res["optimizer_state"] == 2 * 4 * n + 4 * tensors


def test_late_stage_is_truncated_to_the_chosen_rank():
    cfg = tiny_config()
    v = build_variant("comera_late", cfg, BenchConfig(late_compression=60.0))
    cap = v.info["max_rank"]
    assert v.info["truncated"] and cap < 4
    stored = 0
    for _, layer in comera.gated_layers(v.model):
        assert max(layer.bonds) <= cap  # physically smaller cores, not just masked
        stored += sum(c.numel() for c in layer.cores)
        stored += layer.bias.numel() if layer.bias is not None else 0
    dense = sum(m.dense_num_parameters() for _, m in comera.gated_layers(v.model))
    assert tt_layer_compression(v.model) == pytest.approx(dense / stored)
    # the cap is the best one in log ratio: its neighbours on a fresh model are no closer
    fresh = build_variant("comera_early", cfg, BenchConfig()).model
    assert late_stage_cap(fresh, 60.0) == cap
    err = abs(math.log(tt_layer_compression(fresh, cap) / 60.0))
    for other in (cap - 1, cap + 1):
        if other >= 1:
            assert abs(math.log(tt_layer_compression(fresh, other) / 60.0)) >= err
    v.step(make_batch(cfg, 2, SEQ))  # trains after truncation


def test_tltorch_tt_layer_equals_its_dense_reconstruction():
    layer = TltorchTTLinear((2, 3, 2), (3, 2, 2), (1, 2, 3, 4, 3, 2, 1), seed=3).double()
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(5, 12, dtype=torch.float64)
    w = tt_to_dense(list(layer.weight.factors))  # (12, 12), independent tensordot chain
    torch.testing.assert_close(layer(x), x @ w + layer.bias, rtol=1e-12, atol=1e-12)


def test_tltorch_transformer_swaps_every_encoder_linear():
    cfg = tiny_config()
    import tltorch

    for fmt in ("tt", "blocktt"):
        model = tltorch_transformer(cfg, fmt).double()
        block = model.blocks[0]
        layers = [block.attn.q, block.attn.k, block.attn.v, block.attn.o, block.ffn_in,
                  block.ffn_out]
        assert not any(isinstance(m, torch.nn.Linear) for m in layers)
        assert isinstance(model.tokens, tltorch.FactorizedEmbedding)
        ref = comera.TTEmbedding(VOCAB, D, (25, 40), (8, 8), 4)
        assert list(model.tokens.weight.rank) == list(ref.bonds)
        if fmt == "blocktt":  # TT-matrix cores (r, o_k, i_k, r'): rebuild W (out, in) by hand
            a, b = block.ffn_in.weight.factors
            w = torch.einsum("xoiy,ypjz->opij", a, b).reshape(FF, D)
            x = torch.randn(3, D, dtype=torch.float64)
            torch.testing.assert_close(block.ffn_in(x), x @ w.T + block.ffn_in.bias,
                                       rtol=1e-10, atol=1e-12)
        ids = torch.randint(1, VOCAB, (2, SEQ))
        model(ids).sum().backward()
        assert all(p.grad is not None for p in model.blocks.parameters())


def test_bad_settings_raise_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="nope"):
        BenchConfig(variants=("nope",))
    with pytest.raises(ConfigError, match="batches"):
        BenchConfig(batches=(0,))
    with pytest.raises(ConfigError, match="late_compression"):
        BenchConfig(late_compression=1.0)
    with pytest.raises(ConfigError, match="max_len"):
        make_batch(tiny_config(), 1, SEQ + 1)
    with pytest.raises(ConfigError, match="rank"):
        GaLoreConfig(rank=0)
    with pytest.raises(ConfigError, match="factorization"):
        tltorch_transformer(tiny_config(), "cp")
    with pytest.raises(SystemExit):
        main(["--variants", "nope", "--out", str(tmp_path / "x")])


def test_memory_mode_and_block_checkpointing_reach_the_model():
    with pytest.raises(ConfigError, match="choose one of fast, balanced, min"):
        BenchConfig(memory="low")
    v = build_variant("comera_early", tiny_config(), BenchConfig(memory="min"))
    assert all(m.memory == "min" for _, m in comera.gated_layers(v.model))
    assert not v.model.checkpoint_blocks
    for name in ("dense", "comera_early"):
        v = build_variant(name, tiny_config(), BenchConfig(checkpoint_blocks=True))
        assert v.model.checkpoint_blocks


@pytest.mark.skipif(not rss_available(), reason="needs Linux /proc/self/clear_refs")
def test_peak_in_this_process_counts_a_variant_above_the_imports():
    bench = BenchConfig(batches=(2,), repeats=1, warmup=0)
    dense = peak_in_this_process("dense", tiny_config(), bench, 2)
    assert dense["variant"] == "dense" and dense["steps"] == 1
    assert dense["peak_rss_delta_bytes"] == dense["peak_rss_bytes"] - dense["rss_before_bytes"]
    assert dense["peak_rss_delta_bytes"] >= 0


@pytest.mark.slow
@pytest.mark.skipif(not rss_available(), reason="needs Linux /proc/self/clear_refs")
def test_process_peak_runs_each_variant_in_its_own_process():
    bench = BenchConfig(batches=(1,), repeats=1, warmup=0, variants=("dense", "comera_early"))
    out = run_benchmark(tiny_config(), bench, model_args=["--smoke"])
    (r,) = out["results"]
    assert set(r["process_peak"]) == {"dense", "comera_early"}
    for name, peak in r["process_peak"].items():  # --smoke: one warm-up step, one more
        assert (peak["variant"], peak["batch"], peak["steps"]) == (name, 1, 2)
        assert peak["peak_rss_delta_bytes"] > 0
    assert r["rss_ratio_vs_dense"]["dense"] == 1.0
    assert "less than dense)" in render_markdown(out)


def test_child_processes_get_the_same_model_flags():
    parser_args = argparse.Namespace(smoke=False, small=True, warmup=2, late_compression=361.0,
                                     seq_len=64, galore_rank=None, tltorch_rank=None,
                                     threads=1, memory=None, checkpoint_blocks=False)
    assert model_args(parser_args) == ["--small", "--warmup", "2", "--late-compression",
                                       "361.0", "--seq-len", "64", "--threads", "1"]
    parser_args.memory, parser_args.checkpoint_blocks = "min", True
    assert model_args(parser_args)[-3:] == ["--memory", "min", "--checkpoint-blocks"]


def test_write_uses_the_results_format(payload, tmp_path):
    json_path, md_path = write_results_to(str(tmp_path / "sub" / "bench"), payload, "# table")
    assert json.loads(json_path.read_text())["results"][0]["batch"] == 1
    assert md_path.read_text() == "# table\n"


@pytest.mark.slow
def test_galore_variant_runs_galore_adamw_on_low_rank_state():
    galore_torch = pytest.importorskip("galore_torch", reason="the bench extra: "
                                       "pip install -e '.[bench]'")

    cfg = tiny_config()
    rank = 8
    v = build_variant("galore", cfg, BenchConfig(galore_rank=rank))
    assert isinstance(v.optimizer, galore_torch.GaLoreAdamW)
    projected = [g for g in v.optimizer.param_groups if "rank" in g]
    assert len(projected) == 1
    group = projected[0]
    assert (group["rank"], group["update_proj_gap"], group["scale"], group["proj_type"]) == (
        rank, 200, 0.25, "std")
    block = v.model.blocks[0]
    expected = {id(m.weight) for m in (block.attn.q, block.attn.k, block.attn.v, block.attn.o,
                                       block.ffn_in, block.ffn_out)}
    assert {id(p) for p in group["params"]} == expected
    v.step(make_batch(cfg, 2, SEQ))
    state_bytes = 0
    for p in v.model.parameters():
        state = v.optimizer.state[p]
        if id(p) in expected:  # std projection: the smaller side is projected to `rank`
            m, n = p.shape
            low = (m, rank) if m >= n else (rank, n)
            ortho = (rank, n) if m >= n else (m, rank)
            assert tuple(state["exp_avg"].shape) == low
            assert tuple(state["projector"].ortho_matrix.shape) == ortho
            # galore_torch slices the projection out of the SVD factor (Vh or U, min(m, n)
            # squared), and the view keeps that whole factor alive: it counts as resident
            state_bytes += 4 * (2 * math.prod(low) + min(m, n) ** 2)
        else:
            state_bytes += 4 * 2 * p.numel()  # plain Adam moments; GaLore's step is an int
    assert resident_bytes(v.model, v.optimizer)["optimizer_state"] == state_bytes

    bench = BenchConfig(batches=(1,), repeats=1, warmup=1,
                        variants=("dense", "galore", "comera_early"), galore_rank=rank)
    out = run_benchmark(cfg, bench)
    r = out["results"][0]
    assert all(math.isfinite(t) and t > 0 for t in r["ms"].values())
    assert r["galore_refresh"]["refresh_step_ms"] > 0
    assert set(r["comera_vs_galore"]) == {"comera_early"}
    assert out["variants"]["galore"]["optimizer"].startswith("galore_torch.")
    assert {t["claim"] for t in out["targets"]} == {"train step faster than GaLore",
                                                    "peak memory lower than GaLore"}
