"""One training step of the paper's six-encoder transformer: dense vs CoMERA (early and late
stage), GaLore and tensorly-torch TT layers, side by side in one process.

A step is forward, cross-entropy loss, backward and the optimizer step, on one fixed batch of
random token ids (no padding). Variants (``--variants``):

- ``dense``: the dense model with ``torch.optim.AdamW``;
- ``galore``: the dense model with ``galore_torch.GaLoreAdamW`` (the GaLore recipe; see
  benchmarks/lib/model_baselines.py for the rank);
- ``comera_early``: TT layers at the initial ranks, the rank regulariser in the objective, via
  ``comera.CoMERATrainer``;
- ``comera_late``: gates pruned to one max rank chosen so the TT layers reach the paper's
  late-stage compression (``--late-compression``), truncated physically by
  ``CoMERATrainer.start_late_stage``, then late-stage steps;
- ``tltorch_tt`` / ``tltorch_blocktt``: every encoder linear as a tensorly-torch TT
  (reconstructed) or BlockTT (factorized einsum) layer at CoMERA's initial max rank, and the
  token embedding as tltorch's BlockTT embedding at the modes and ranks of CoMERA's.

Time: median of interleaved repeats after warm-up (``measure.interleaved_times``). Memory, two
ways: the torch accounting (resident bytes before the step plus the profiler's peak allocated
during one step, see ``MEMORY_COUNTED``) and, next to it, what the system sees: the peak RSS of
dense, GaLore and CoMERA each measured in a process of its own (see ``PROCESS_COUNTED``;
``--no-process-peak`` skips it). ``--memory {fast,balanced,min}`` plans the TT layers in that
tncomp memory mode (an error where the installed tncomp has none). Writes
benchmarks/results/transformer_cpu.{json,md} (``--small``: transformer_small_cpu).

    python -m benchmarks.speed.bench_transformer --smoke --out /tmp/t   # the quickest run (~1 min)
    python -m benchmarks.speed.bench_transformer --small --repeats 3 --threads 1
    python -m benchmarks.speed.bench_transformer --threads 2   # the paper's model: ~10-15 min
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch
from torch import Tensor, nn
from torch.nn import functional as F

import comera
from benchmarks.lib.cli import add_out
from benchmarks.lib.measure import (
    interleaved_times,
    markdown_table,
    measure_step_memory,
    publish,
    ratio,
    ratio_spread,
    run_fresh,
    spread_text,
    start_run,
    timed,
)
from benchmarks.lib.memory import MEMORY_MODES, check_memory_mode, peak_rss_of, set_memory_mode_
from benchmarks.lib.model_baselines import (
    GaLoreConfig,
    default_galore_rank,
    galore_targets,
    make_galore_optimizer,
    tltorch_transformer,
)
from comera.errors import ConfigError
from comera.experiments.results import machine
from comera.models.transformer import PairClassifier, TransformerConfig

log = logging.getLogger("bench_transformer")

VARIANTS = ("dense", "galore", "comera_early", "comera_late", "tltorch_tt", "tltorch_blocktt")
COMERA_VARIANTS = ("comera_early", "comera_late")
# CoMERA paper, Table 1 (MNLI transformer): the late stage compresses the tensorized layers
# (linears + embedding) 361x against their dense counterparts (74x for the whole model).
PAPER_LATE_COMPRESSION = 361.0
SMALL_VOCAB = 30522  # --small keeps the BERT vocabulary; only the widths and depth shrink

PROCESS_VARIANTS = ("dense", "galore", "comera_early", "comera_late")  # peak RSS per process
SHOWN_LAYERS = ("tokens", "blocks.0.attn.q", "blocks.0.ffn_in", "blocks.0.ffn_out")
MEMORY_COUNTED = (
    "peak_total_bytes = resident_bytes.total + peak_extra_bytes. resident_bytes: unique storages "
    "held before the step with gradients set to None: parameters, buffers, optimizer state "
    "(Adam moments and step counters; GaLore's projection matrices) and the input batch. "
    "peak_extra_bytes: peak of the bytes allocated above that during one step (forward, loss, "
    "backward with freshly allocated gradients, optimizer step), from the torch profiler's "
    "memory events (harness.peak_allocated_bytes). grads_bytes: the gradients at the end of the "
    "step (part of peak_extra_bytes); activations_and_temporaries_bytes = peak_extra_bytes - "
    "grads_bytes. CoMERA variants run with tncomp's buffer pooling off while measured, so every "
    "buffer is a fresh allocation. Not counted: allocator overhead, Python objects, plan caches."
)
PROCESS_COUNTED = (
    "process_peak: what the operating system sees. Each variant runs in a fresh interpreter "
    "(python -m benchmarks.speed.bench_transformer --process-peak VARIANT B, the same model flags) "
    "after the same imports (galore_torch included) and one AdamW step of a 2x2 linear layer "
    "(torch's first-use set-up, the same for every variant); then the resident set is read "
    "(rss_before), the peak reset (Linux /proc/self/clear_refs), the variant built and "
    "warmup + 1 training steps run on the same batch. peak_rss_delta = peak resident set - "
    "rss_before: the model, optimizer state, activations and all the allocator and libraries "
    "hold (plans, generated code, allocator caching). CPU only, as the script (on a GPU the "
    "counterpart is torch.cuda.max_memory_allocated)."
)


@dataclass(frozen=True)
class BenchConfig:
    """What to run. ``seq_len`` None: the model's ``max_len``; ``galore_rank`` None:
    ``default_galore_rank(d_model)``; ``tltorch_rank`` None: the model's TT rank."""

    batches: tuple[int, ...] = (1, 32)
    repeats: int = 5
    warmup: int = 2
    variants: tuple[str, ...] = VARIANTS
    seq_len: int | None = None
    galore_rank: int | None = None
    late_compression: float = PAPER_LATE_COMPRESSION
    lam: float = 0.01
    lr: float = 1e-4
    tltorch_rank: int | None = None
    seed: int = 0
    memory: str | None = None  # tncomp's planning memory mode for the TT layers (None: default)
    checkpoint_blocks: bool = False  # recompute each encoder block in the backward (every model)

    def __post_init__(self) -> None:
        check_memory_mode(self.memory)
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            raise ConfigError(f"variants {list(self.variants)}: unknown {unknown}; choose from "
                              f"{', '.join(VARIANTS)}.")
        if not self.batches or any(isinstance(b, bool) or b < 1 for b in self.batches):
            raise ConfigError(f"batches={self.batches}; give one or more batch sizes >= 1.")
        if self.repeats < 1 or self.warmup < 0:
            raise ConfigError(f"repeats={self.repeats}, warmup={self.warmup}; need repeats >= 1 "
                              "and warmup >= 0.")
        if self.seq_len is not None and self.seq_len < 1:
            raise ConfigError(f"seq_len={self.seq_len}; give a length >= 1 (or None).")
        for what in ("galore_rank", "tltorch_rank"):
            value = getattr(self, what)
            if value is not None and value < 1:
                raise ConfigError(f"{what}={value}; give a rank >= 1 (or None for the default).")
        if not self.late_compression > 1:
            raise ConfigError(f"late_compression={self.late_compression}; the late-stage target "
                              "is a compression ratio > 1 (the paper: 361).")


@dataclass(frozen=True)
class Batch:
    ids: Tensor  # (B, S) int64, no padding
    segments: Tensor  # (B, S) int64 in {0, 1}
    labels: Tensor  # (B,) int64

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.ids, self.segments, self.labels)


def make_batch(cfg: TransformerConfig, batch: int, seq_len: int, seed: int = 0) -> Batch:
    """Random token ids in [1, vocab) (id 0 is the pad id), segment ids and labels."""
    if seq_len > cfg.max_len:
        raise ConfigError(f"seq_len={seq_len} exceeds the model's max_len={cfg.max_len}.")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, cfg.vocab_size, (batch, seq_len), generator=gen)
    segments = (torch.arange(seq_len) >= seq_len // 2).long().expand(batch, seq_len).contiguous()
    labels = torch.randint(0, cfg.n_classes, (batch,), generator=gen)
    return Batch(ids, segments, labels)


@dataclass
class Variant:
    """A model, its optimizer, and ``step(batch)``: one full training step."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[Batch], None]
    info: dict = field(default_factory=dict)


def _loss(model: nn.Module, batch: Batch) -> Tensor:
    return F.cross_entropy(model(batch.ids, batch.segments), batch.labels)


def _plain_step(model: nn.Module, optimizer) -> Callable[[Batch], None]:
    """Forward, loss, zero_grad, backward, step: the order CoMERATrainer.step uses."""

    def step(batch: Batch) -> None:
        loss = _loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def _trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _qualname(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


# --------------------------------------------------------------------------------------------
# CoMERA late stage: prune to one max rank, truncate
# --------------------------------------------------------------------------------------------


def _size_at_cap(layer: comera.GatedLayer, cap: int) -> int:
    """Parameters of ``layer`` with every effective rank capped at ``cap``."""
    ranks = [min(r, cap) for r in layer.ranks]
    bias = layer.bias.numel() if layer.bias is not None else 0
    return bias + sum(ranks[k] * math.prod(c.shape[1:-1]) * ranks[k + 1]
                      for k, c in enumerate(layer.cores))


def tt_layer_compression(model: nn.Module, cap: int | None = None) -> float:
    """Dense size / effective size of the TT layers alone (linears and embedding), optionally
    with every rank capped at ``cap``: the paper's compression of the tensorized layers."""
    layers = [m for _, m in comera.gated_layers(model)]
    if not layers:
        raise ConfigError("the model has no TT layers; build it with "
                          "TransformerConfig(linear_format='tt').")
    dense = sum(m.dense_num_parameters() for m in layers)
    size = sum(_size_at_cap(m, cap) if cap is not None else m.num_parameters() for m in layers)
    return dense / max(size, 1)


def late_stage_cap(model: nn.Module, target: float) -> int:
    """The max rank whose TT-layer compression is closest (in log ratio) to ``target``."""
    top = max(max(m.ranks) for _, m in comera.gated_layers(model))
    return min(range(1, top + 1),
               key=lambda c: abs(math.log(tt_layer_compression(model, c) / target)))


def prune_gates_to_cap_(model: nn.Module, cap: int) -> None:
    """Zero every gate entry past the first ``cap`` surviving ones (pruned: |g| <= tau)."""
    with torch.no_grad():
        for _, layer in comera.gated_layers(model):
            for gate, mask in zip(layer.gates, layer.gate_masks(), strict=True):
                alive = torch.nonzero(mask).flatten()
                gate[alive[cap:]] = 0.0


# --------------------------------------------------------------------------------------------
# Variants
# --------------------------------------------------------------------------------------------


def build_variant(name: str, cfg: TransformerConfig, bench: BenchConfig) -> Variant:
    """Build one variant from scratch (seeded, so every run builds the same weights), its
    encoder blocks checkpointed when ``bench.checkpoint_blocks`` (every variant alike)."""
    variant = _build_variant(name, cfg, bench)
    variant.model.checkpoint_blocks = bench.checkpoint_blocks
    return variant


def _build_variant(name: str, cfg: TransformerConfig, bench: BenchConfig) -> Variant:
    if name not in VARIANTS:
        raise ConfigError(f"variant {name!r}; choose from {', '.join(VARIANTS)}.")
    torch.manual_seed(bench.seed)
    dense_cfg = replace(cfg, linear_format="dense")
    if name == "dense":
        model = PairClassifier(dense_cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=bench.lr, weight_decay=0.0)
        return Variant(name, model, opt, _plain_step(model, opt),
                       {"optimizer": _qualname(opt), "params": _trainable(model)})
    if name == "galore":
        model = PairClassifier(dense_cfg)
        galore = GaLoreConfig(rank=bench.galore_rank or default_galore_rank(cfg.d_model),
                              lr=bench.lr)
        opt = make_galore_optimizer(model, galore)
        targets = galore_targets(model)
        return Variant(name, model, opt, _plain_step(model, opt), {
            "optimizer": _qualname(opt), "params": _trainable(model), **asdict(galore),
            "projected_matrices": len(targets),
            "projected_params": sum(p.numel() for _, p in targets),
            "note": "standard GaLoreAdamW: full-size gradients (no per-layer weight updates); "
                    "each projection matrix is a view into its SVD factor (min(m, n)^2 floats), "
                    "which stays resident and is counted"})
    if name in COMERA_VARIANTS:
        model = PairClassifier(cfg)  # the layers in cfg's format (TT by default)
        set_memory_mode_(model, bench.memory)
        opt = comera.make_optimizer(model)
        trainer = comera.CoMERATrainer(model, opt, lam=bench.lam)
        info: dict = {"optimizer": _qualname(opt), "lam": bench.lam,
                      "memory_mode": bench.memory or "default"}
        if name == "comera_late":
            cap = late_stage_cap(model, bench.late_compression)
            prune_gates_to_cap_(model, cap)
            report = trainer.start_late_stage(
                comera.LateStage(target_size=float(comera.model_size(model))))
            info.update({"target_tt_compression": bench.late_compression, "max_rank": cap,
                         "truncated": report.changed,
                         "objective": "late stage at its target size: the loss is weighted"})
        info.update({"params": _trainable(model), "effective_size": comera.model_size(model),
                     "tt_layer_compression": tt_layer_compression(model),
                     "model_compression": comera.compression_ratio(model),
                     "bonds": {n: list(m.bonds) for n, m in comera.gated_layers(model)
                               if n in SHOWN_LAYERS}})

        def step(batch: Batch) -> None:
            trainer.step(_loss(model, batch))

        return Variant(name, model, opt, step, info)
    fmt = name.removeprefix("tltorch_")
    model = tltorch_transformer(cfg, fmt, bench.tltorch_rank, seed=bench.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=bench.lr, weight_decay=0.0)
    return Variant(name, model, opt, _plain_step(model, opt), {
        "optimizer": _qualname(opt), "params": _trainable(model), "factorization": fmt,
        "max_rank": bench.tltorch_rank or cfg.rank, "layer": _qualname(model.blocks[0].attn.q)})


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------


def measure_memory(variant: Variant, batch: Batch) -> dict:
    """Peak memory of one whole step (see ``MEMORY_COUNTED``)."""
    return measure_step_memory(variant.model, variant.optimizer, lambda: variant.step(batch),
                               batch.tensors())


def peak_in_this_process(name: str, cfg: TransformerConfig, bench: BenchConfig,
                         batch_size: int) -> dict:
    """Build ``name`` and run ``warmup + 1`` steps here (a fresh interpreter): the peak
    resident set above the one after the imports (see ``PROCESS_COUNTED``)."""
    with contextlib.suppress(ImportError):  # every variant pays the same imports
        import galore_torch  # noqa: F401
    warm = nn.Linear(2, 2)  # torch's first-use set-up (autograd, AdamW) is not the variant's
    opt = torch.optim.AdamW(warm.parameters())
    warm(torch.ones(1, 2)).sum().backward()
    opt.step()
    del warm, opt

    def run() -> None:
        variant = build_variant(name, cfg, bench)
        batch = make_batch(cfg, batch_size, bench.seq_len or cfg.max_len,
                           bench.seed + batch_size)
        for _ in range(bench.warmup + 1):
            variant.step(batch)

    return {"variant": name, "batch": batch_size, "steps": bench.warmup + 1,
            **peak_rss_of(run)}


def process_peak(name: str, batch_size: int, model_args: list[str]) -> dict:
    """:func:`peak_in_this_process` in a fresh interpreter, with the parent's model flags."""
    return run_fresh("benchmarks.speed.bench_transformer",
                     ["--process-peak", name, str(batch_size), *model_args])


# --------------------------------------------------------------------------------------------
# Timing and the run
# --------------------------------------------------------------------------------------------


def galore_refresh_ms(variant: Variant, batch: Batch) -> float:
    """Time of one step that refreshes every projection (an SVD per projected matrix)."""
    opt = variant.optimizer
    for group in opt.param_groups:
        if "rank" not in group:
            continue
        gap = group["update_proj_gap"]
        for p in group["params"]:
            state = opt.state.get(p)
            if state is not None and "step" in state:
                state["step"] = math.ceil(state["step"] / gap) * gap  # refresh on this step
    return timed(lambda: variant.step(batch)).seconds * 1e3


def run_batch(variants: dict[str, Variant], batch: Batch, bench: BenchConfig,
              model_args: list[str] | None = None) -> dict:
    """Interleaved timing, per-variant memory and ratios at one batch size; with
    ``model_args`` (the model's command-line flags), each variant's peak RSS measured in a
    process of its own."""
    size = int(batch.ids.shape[0])
    log.info("batch %d: timing %s", size, ", ".join(variants))
    times = interleaved_times({n: (lambda v=v: v.step(batch)) for n, v in variants.items()},
                              bench.repeats, bench.warmup)
    ms = {n: statistics.median(ts) * 1e3 for n, ts in times.items()}
    out: dict = {"batch": size, "seq_len": int(batch.ids.shape[1]), "ms": ms}
    if "galore" in variants:
        gap = variants["galore"].info["update_proj_gap"]
        refresh = galore_refresh_ms(variants["galore"], batch)
        out["galore_refresh"] = {"refresh_step_ms": refresh, "update_proj_gap": gap,
                                 "amortized_ms": ms["galore"] + (refresh - ms["galore"]) / gap}
    log.info("batch %d: memory", size)
    memory = {n: measure_memory(v, batch) for n, v in variants.items()}
    out["memory"] = memory
    if model_args is not None:
        out["process_peak"] = {n: process_peak(n, size, model_args) for n in variants
                               if n in PROCESS_VARIANTS}
    peak = {n: m["peak_total_bytes"] for n, m in memory.items()}
    rss = {n: p["peak_rss_delta_bytes"] for n, p in out.get("process_peak", {}).items()}
    if "dense" in variants:
        out["speedup_vs_dense"] = {n: ratio(ms["dense"], t) for n, t in ms.items()}
        out["speedup_vs_dense_spread"] = {n: ratio_spread(times["dense"], ts)
                                          for n, ts in times.items()}
        out["memory_ratio_vs_dense"] = {n: ratio(peak["dense"], p) for n, p in peak.items()}
        if "dense" in rss:
            out["rss_ratio_vs_dense"] = {n: ratio(rss["dense"], p) for n, p in rss.items()}
    if "galore" in variants:
        amortized = out["galore_refresh"]["amortized_ms"]
        out["comera_vs_galore"] = {
            n: {"speedup": ratio(ms["galore"], ms[n]),
                "speedup_spread": ratio_spread(times["galore"], times[n]),
                "speedup_amortized_refresh": ratio(amortized, ms[n]),
                "memory_ratio": ratio(peak["galore"], peak[n]),
                **({"rss_ratio": ratio(rss["galore"], rss[n])} if n in rss and "galore" in rss
                   else {})}
            for n in COMERA_VARIANTS if n in variants}
    return out


TARGETS = (  # (claim, batch, result key, reference variant, target): issue 14's
    ("train step faster than dense", 32, "speedup_vs_dense", "dense", 3.0),
    ("peak memory lower than dense", 32, "memory_ratio_vs_dense", "dense", 3.0),
    ("train step faster than GaLore", 1, "speedup", "galore", 3.0),
    ("peak memory lower than GaLore", 1, "memory_ratio", "galore", 15.0),
)


def check_targets(results: list[dict]) -> list[dict]:
    """The issue's targets, for each CoMERA stage measured in this run."""
    rows = []
    for claim, size, key, _, target in TARGETS:
        r = next((r for r in results if r["batch"] == size), None)
        if r is None:
            continue
        for name in COMERA_VARIANTS:
            if key in ("speedup", "memory_ratio"):
                value = r.get("comera_vs_galore", {}).get(name, {}).get(key)
            else:
                value = r.get(key, {}).get(name)
            if value is not None:
                rows.append({"variant": name, "claim": claim, "batch": size,
                             "measured": value, "target": target, "met": value >= target})
    return rows


def run_benchmark(cfg: TransformerConfig, bench: BenchConfig,
                  model_args: list[str] | None = None) -> dict:
    """Build every variant, run every batch size, return the JSON payload; ``model_args``:
    see :func:`run_batch`."""
    variants = {}
    for name in bench.variants:
        log.info("building %s", name)
        variants[name] = build_variant(name, cfg, bench)
    seq_len = bench.seq_len or cfg.max_len
    results = [run_batch(variants, make_batch(cfg, b, seq_len, bench.seed + b), bench,
                         model_args) for b in bench.batches]
    return {"machine": machine(), "model": asdict(cfg), "bench": asdict(bench),
            "variants": {n: v.info for n, v in variants.items()},
            "memory_counted": MEMORY_COUNTED, "process_counted": PROCESS_COUNTED,
            "results": results,
            "targets": check_targets(results)}


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def smoke_config() -> TransformerConfig:
    """A toy model (one block, d_model 64, vocabulary 1,000, two modes per side: planning d=2
    trains is quick on a cold cache) for ``--smoke`` and the tests."""
    return TransformerConfig.small(
        vocab_size=1000, d_model=64, n_heads=2, d_ff=256, n_layers=1, rank=4, embedding_rank=4,
        max_len=16, attn_modes=((8, 8), (8, 8)), ffn_in_modes=((8, 8), (16, 16)),
        ffn_out_modes=((16, 16), (8, 8)), embedding_modes=((25, 40), (8, 8)))


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _spread(spread: dict | None) -> str:
    return "-" if spread is None else spread_text(spread)


def render_markdown(payload: dict) -> str:
    """The results as markdown tables (one per batch size, then CoMERA vs GaLore, targets)."""
    m, cfg, bench = payload["machine"], payload["model"], payload["bench"]
    lines = [
        "# Transformer training step (CPU): dense vs CoMERA vs GaLore vs tensorly-torch",
        "",
        f"torch {m['torch']}, {m['cpu']}, {m['threads']} threads, commit {m['commit']}, "
        f"{m['date']}. Model: d_model {cfg['d_model']}, FFN {cfg['d_ff']}, {cfg['n_layers']} "
        f"layers, vocab {cfg['vocab_size']}, TT rank {cfg['rank']}. One step = forward, loss, "
        f"backward, optimizer step. Median of {bench['repeats']} interleaved repeats after "
        f"{bench['warmup']} warm-up steps; ratios within this run, each with the quartiles and "
        "range of its per-round ratios.",
    ]
    for r in payload["results"]:
        rows = []
        for name, t in r["ms"].items():
            mem = r["memory"][name]
            res = mem["resident_bytes"]
            rss = r.get("process_peak", {}).get(name)
            rows.append([
                name, f"{t:.1f}", _spread(r.get("speedup_vs_dense_spread", {}).get(name)),
                _mib(mem["peak_total_bytes"]),
                "-" if rss is None else (_mib(rss["peak_rss_delta_bytes"]) + " ("
                                         + _times(r.get("rss_ratio_vs_dense", {}).get(name))
                                         + " less than dense)"),
                _times(r.get("memory_ratio_vs_dense", {}).get(name)),
                _mib(res["params"]), _mib(mem["grads_bytes"]), _mib(res["optimizer_state"]),
                _mib(mem["activations_and_temporaries_bytes"]),
                f"{payload['variants'][name]['params']:,}"])
        lines += ["", f"## batch {r['batch']} x {r['seq_len']} tokens", "",
                  markdown_table(["variant", "ms/step", "speedup vs dense", "peak MiB",
                                  "peak RSS MiB (own process)", "dense / peak", "params MiB",
                                  "grads MiB", "opt state MiB", "activations + temps MiB",
                                  "trainable params"], rows)]
        if "galore_refresh" in r:
            g = r["galore_refresh"]
            lines += ["", f"GaLore projection refresh step: {g['refresh_step_ms']:.1f} ms, once "
                          f"every {g['update_proj_gap']} steps: {g['amortized_ms']:.1f} ms/step "
                          "amortized."]
        for name, c in r.get("comera_vs_galore", {}).items():
            lines.append(f"{name} vs GaLore: {spread_text(c['speedup_spread'])} faster "
                         f"({c['speedup_amortized_refresh']:.2f}x with refreshes amortized), "
                         f"{c['memory_ratio']:.2f}x less peak memory"
                         + (f" ({c['rss_ratio']:.2f}x less peak RSS)." if "rss_ratio" in c
                            else "."))
    if payload["targets"]:
        rows = [[t["variant"], t["claim"], t["batch"], f"{t['measured']:.2f}x",
                 f">= {t['target']:.0f}x", "yes" if t["met"] else "**no**"]
                for t in payload["targets"]]
        lines += ["", "## Targets", "",
                  markdown_table(["variant", "claim", "batch", "measured", "target", "met"],
                                 rows)]
    v = payload["variants"]
    notes = [f"- Memory (peak MiB and its parts): {payload['memory_counted']}"]
    if "process_counted" in payload and any("process_peak" in r for r in payload["results"]):
        notes.append(f"- Peak RSS (own process): {payload['process_counted']}")
    if payload["bench"].get("memory"):
        notes.append(f"- TT layers planned in tncomp's {payload['bench']['memory']!r} memory "
                     "mode (--memory).")
    if payload["bench"].get("checkpoint_blocks"):
        notes.append("- Every variant recomputes each encoder block in the backward "
                     "(--checkpoint-blocks: model.checkpoint_blocks).")
    if "galore" in v:
        notes.append(f"- GaLore: {v['galore']['optimizer']}, rank {v['galore']['rank']}, "
                     f"update_proj_gap {v['galore']['update_proj_gap']}, scale "
                     f"{v['galore']['scale']}, proj_type {v['galore']['proj_type']}, on "
                     f"{v['galore']['projected_matrices']} attention/FFN weights; "
                     f"{v['galore']['note']}.")
    if "comera_late" in v:
        late = v["comera_late"]
        notes.append(f"- CoMERA late stage: ranks capped at {late['max_rank']}, TT layers "
                     f"{late['tt_layer_compression']:.0f}x smaller than dense (target "
                     f"{late['target_tt_compression']:.0f}x), whole model "
                     f"{late['model_compression']:.1f}x.")
    for name in ("tltorch_tt", "tltorch_blocktt"):
        if name in v:
            notes.append(f"- {name}: every encoder linear as {v[name]['layer']} "
                         f"({v[name]['factorization']}, max rank {v[name]['max_rank']}), the token "
                         "embedding as tltorch.FactorizedEmbedding (BlockTT) at CoMERA's modes "
                         "and ranks; torch AdamW.")
    lines += ["", "## Notes", "", *notes]
    return "\n".join(lines)


def model_args(args: argparse.Namespace) -> list[str]:
    """The flags that make a child process build the same model, variants and steps."""
    out = ["--smoke"] if args.smoke else ["--small"] if args.small else []
    out += ["--warmup", str(args.warmup), "--late-compression", str(args.late_compression)]
    for flag, value in (("--seq-len", args.seq_len), ("--galore-rank", args.galore_rank),
                        ("--tltorch-rank", args.tltorch_rank), ("--threads", args.threads),
                        ("--memory", args.memory)):
        if value is not None:
            out += [flag, str(value)]
    return out + (["--checkpoint-blocks"] if args.checkpoint_blocks else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true",
                        help="TransformerConfig.small (d_model 256, 2 layers) instead of the "
                             "paper's model")
    parser.add_argument("--smoke", action="store_true",
                        help="quickest run: a one-block toy model, batch 1, one repeat, no "
                             "GaLore (checks the script, measures nothing)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--galore-rank", type=int, default=None)
    parser.add_argument("--late-compression", type=float, default=PAPER_LATE_COMPRESSION)
    parser.add_argument("--tltorch-rank", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--memory", choices=MEMORY_MODES, default=None,
                        help="tncomp's planning memory mode for the TT layers")
    parser.add_argument("--checkpoint-blocks", action="store_true",
                        help="recompute each encoder block in the backward, in every variant "
                             "(model.checkpoint_blocks)")
    parser.add_argument("--no-process-peak", action="store_true",
                        help="skip the peak RSS of each variant in a process of its own")
    parser.add_argument("--process-peak", nargs=2, metavar=("VARIANT", "BATCH"),
                        help="measure one variant's peak RSS in this process, print it as JSON "
                             "(what the parent runs in a fresh interpreter)")
    add_out(parser, None, "default transformer_cpu, or transformer_small_cpu with --small")
    args = parser.parse_args(argv)
    start_run(parser, args.threads)
    if args.smoke:
        args.batch, args.repeats, args.warmup, args.late_compression = [1], 1, 1, 60.0
        args.variants = [v for v in args.variants if v != "galore"]
    try:
        bench = BenchConfig(batches=tuple(args.batch), repeats=args.repeats,
                            warmup=args.warmup, variants=tuple(dict.fromkeys(args.variants)),
                            seq_len=args.seq_len, galore_rank=args.galore_rank,
                            late_compression=args.late_compression,
                            tltorch_rank=args.tltorch_rank, memory=args.memory,
                            checkpoint_blocks=args.checkpoint_blocks)
    except ConfigError as exc:
        parser.error(str(exc))
    cfg = (smoke_config() if args.smoke else TransformerConfig.small(SMALL_VOCAB) if args.small
           else TransformerConfig())
    if args.process_peak:
        name, size = args.process_peak
        if name not in VARIANTS or not size.isdigit() or int(size) < 1:
            parser.error(f"--process-peak {name} {size}: give one of {', '.join(VARIANTS)} and "
                         "a batch size >= 1")
        print(json.dumps(peak_in_this_process(name, cfg, bench, int(size))))
        return 0
    payload = run_benchmark(cfg, bench, None if args.no_process_peak else model_args(args))
    markdown = render_markdown(payload)
    out = args.out or ("transformer_smoke_cpu" if args.smoke else "transformer_small_cpu"
                       if args.small else "transformer_cpu")
    return publish(out, payload, markdown)


if __name__ == "__main__":
    sys.exit(main())
