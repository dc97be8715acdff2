"""One training step of the reference Criteo-Kaggle DLRM at its full table sizes: dense tables
vs TT tables, side by side in one process.

The model is ``DLRMTaskConfig.full()``'s: 26 tables of 33,762,577 rows in all, dimension 16,
bottom MLP 13-512-256-64-16, top MLP 367-512-256-1; the TT variant stores every table of at least
10,000 rows as a rank-32 TT-matrix (``comera.TTEmbedding``, three cores). A step is forward,
binary cross-entropy, backward and the AdamW step, on one fixed batch whose ids come from the
synthetic Zipf generator (``comera.data.criteo.SyntheticCriteo``) at the model's table sizes:

- ``dense``: ``nn.Embedding`` tables (dense gradients, as in the reference DLRM) and
  ``torch.optim.AdamW`` through ``comera.DenseTrainer`` (the engine's dense step: the same
  non-finite checks as CoMERA's);
- ``tt``: TT tables at their initial ranks, ``comera.make_optimizer``'s three AdamW groups and
  ``comera.CoMERATrainer`` with the rank regulariser in the objective (the early stage);
- ``tt_cache``: ``tt`` with TT-Rec's hot-row cache (``CachedTTEmbedding``): each TT
  table keeps dense rows for its ``cache_rows`` most frequent ids, counted over 65,536 training
  examples of the same generator (issue 13: the lead must survive the cache).

Learning rates and the regulariser weight are the registry's full DLRM run (they do not change
the cost of a step). Time: median of interleaved repeats after warm-up
(``measure.interleaved_times``). Memory: resident bytes before the step plus the peak allocated
during one step (see ``MEMORY_COUNTED``). Writes benchmarks/results/dlrm_step_cpu.{json,md}
(with ``--max-rows N``: dlrm_step_rows{N}_cpu).

    python -m benchmarks.speed.bench_dlrm --max-rows 20000 --batch 256 --threads 1   # seconds
    python -m benchmarks.speed.bench_dlrm --smoke --out /tmp/dlrm   # the quickest run
    python -m benchmarks.speed.bench_dlrm --threads 2     # full tables: ~10 GB RAM, minutes
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor
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
    spread_text,
    start_run,
)
from comera.data.criteo import SyntheticCriteo
from comera.errors import ConfigError
from comera.experiments.dlrm_task import DLRMTaskConfig
from comera.experiments.registry import experiment
from comera.experiments.results import machine
from comera.layers.cached_embedding import CachedTTEmbedding
from comera.models.dlrm import DLRM, DLRMConfig

log = logging.getLogger("bench_dlrm")

VARIANTS = ("dense", "tt", "tt_cache")
HOT_ROW_SAMPLE = 65_536  # training examples whose ids choose the cached rows
# CoMERA paper (Yang et al., NeurIPS 2024), DLRM on Criteo: the TT model is 99x smaller than the
# dense one and trains with 7x lower peak memory (its compression is after rank adaptation; this
# benchmark's TT model is at the initial ranks, the start of the early stage).
PAPER_CLAIMS = {"compression": 99.0, "peak_memory_reduction": 7.0}
MEMORY_COUNTED = (
    "peak_total_bytes = resident_bytes.total + peak_extra_bytes. resident_bytes: unique storages "
    "held before the step with gradients set to None: parameters, buffers, AdamW state (two "
    "moments and a step counter per parameter) and the input batch. peak_extra_bytes: peak of the "
    "bytes allocated above that during one step (forward, loss, backward with freshly allocated "
    "gradients, optimizer step), from the torch profiler's memory events "
    "(harness.peak_allocated_bytes). grads_bytes: the gradients at the end of the step (part of "
    "peak_extra_bytes); activations_and_temporaries_bytes = peak_extra_bytes - grads_bytes. The "
    "TT variant runs with tncomp's buffer pooling off while measured, so every buffer is a fresh "
    "allocation. Not counted: allocator overhead, Python objects, plan caches."
)


@dataclass(frozen=True)
class BenchConfig:
    """What to run. ``max_rows`` caps every table (None: the full Kaggle sizes).
    ``tt_min_rows`` None: the full model's threshold (10,000 rows), lowered to ``max_rows`` when
    that is smaller, so a capped run keeps TT tables."""

    batch: int = 2048
    repeats: int = 3
    warmup: int = 1
    max_rows: int | None = None
    tt_min_rows: int | None = None
    variants: tuple[str, ...] = VARIANTS
    seed: int = 0
    cache_rows: int = 1000  # hot rows per TT table in the tt_cache variant

    def __post_init__(self) -> None:
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            raise ConfigError(f"variants {list(self.variants)}: unknown {unknown}; choose from "
                              f"{', '.join(VARIANTS)}.")
        for name, minimum in (("batch", 1), ("repeats", 1), ("warmup", 0), ("seed", 0),
                              ("cache_rows", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"{name}={value!r}; it must be an int >= {minimum}.")
        for name in ("max_rows", "tt_min_rows"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ConfigError(f"{name}={value!r}; give an int >= 1 (or None).")
        if {"tt", "tt_cache"} & set(self.variants):
            cfg = self.model_config("tt")
            if not any(cfg.is_tt_table(k) for k in range(cfg.num_tables)):
                raise ConfigError(
                    f"tt_min_rows={cfg.tt_min_rows} with max_rows={self.max_rows} leaves no TT "
                    f"table (the largest has {max(cfg.table_sizes)} rows); lower tt_min_rows "
                    "(--tt-min-rows) or raise max_rows.")

    def task_config(self) -> DLRMTaskConfig:
        """``DLRMTaskConfig.full()`` with the table cap and TT threshold applied."""
        full = DLRMTaskConfig.full()
        threshold = self.tt_min_rows or full.tt_min_rows
        if self.tt_min_rows is None and self.max_rows is not None:
            threshold = min(threshold, self.max_rows)
        return DLRMTaskConfig.full(max_rows=self.max_rows, tt_min_rows=threshold)

    def model_config(self, format: str) -> DLRMConfig:
        """The model of :meth:`task_config` with its large tables of the kind ``format``
        (``"dense"``, or a format that holds tables: ``"tt"``'s are TT-matrix tables)."""
        return self.task_config().model_config(format)


@dataclass(frozen=True)
class Batch:
    dense: Tensor  # (B, 13) float32: log(1 + count)
    sparse: Tensor  # (B, 26) int64: one id per table
    labels: Tensor  # (B,) float32 in {0, 1}

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.dense, self.sparse, self.labels)


def make_batch(cfg: DLRMConfig, size: int, seed: int = 0) -> Batch:
    """The first ``size`` training examples of the synthetic Zipf generator at the model's
    (possibly capped) table sizes."""
    data = SyntheticCriteo(cardinalities=cfg.table_sizes, num_dense=cfg.num_dense,
                           seed=seed).generate(size, "train")
    # clone: generate() returns views into whole 8,192-row chunks, which would stay resident
    dense, labels = data.dense.clone(), data.labels.clone()  # (B, J), (B,)
    return Batch(dense, data.sparse.long(), labels)  # sparse (B, T) int64


@dataclass
class Variant:
    """A model, its optimizer and trainer, and ``step(batch)``: one full training step."""

    name: str
    model: DLRM
    optimizer: torch.optim.Optimizer
    trainer: comera.DenseTrainer | comera.CoMERATrainer
    info: dict = field(default_factory=dict)

    def step(self, batch: Batch) -> None:
        logits = self.model(batch.dense, batch.sparse)  # (B,)
        self.trainer.step(F.binary_cross_entropy_with_logits(logits, batch.labels))


def _qualname(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def size_info(model: DLRM) -> dict:
    """Parameter counts and compression of ``model`` against the same model with dense tables."""
    tt_tables = [m.tt if isinstance(m, CachedTTEmbedding) else m
                 for m in model.embeddings
                 if isinstance(m, comera.TTEmbedding | CachedTTEmbedding)]
    info = {
        "params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "effective_size": comera.model_size(model),
        "table_params": model.table_parameters(),
        "dense_table_params": model.dense_table_parameters(),
        "tt_tables": len(tt_tables),
    }
    info["table_compression"] = info["dense_table_params"] / info["table_params"]
    info["model_compression"] = comera.compression_ratio(model)
    if tt_tables:
        largest = max(tt_tables, key=lambda m: m.num_embeddings)
        info["tt_table_compression"] = (sum(m.dense_num_parameters() for m in tt_tables)
                                        / sum(m.num_parameters() for m in tt_tables))
        info["largest_tt_table"] = {"rows": largest.num_embeddings,
                                    "row_modes": list(largest.row_modes),
                                    "col_modes": list(largest.col_modes),
                                    "bonds": list(largest.bonds)}
    return info


def build_variant(name: str, bench: BenchConfig) -> Variant:
    """Build one variant from scratch (seeded, so every run builds the same weights)."""
    if name not in VARIANTS:
        raise ConfigError(f"variant {name!r}; choose from {', '.join(VARIANTS)}.")
    engine = experiment("dlrm").full
    torch.manual_seed(bench.seed)
    cfg = bench.model_config("dense" if name == "dense" else "tt")
    if name == "tt_cache":
        cfg = replace(cfg, tt_cache_rows=bench.cache_rows)
    model = DLRM(cfg)
    hit_shares = None
    if name == "tt_cache":  # the cached ids: the most frequent in a training sample
        hit_shares = model.choose_hot_rows_(make_batch(cfg, HOT_ROW_SAMPLE, bench.seed).sparse)
    if name == "dense":
        opt = torch.optim.AdamW([{"params": list(model.parameters()), "lr": engine.lr,
                                  "name": "other"}], weight_decay=0.0)
        trainer = comera.DenseTrainer(model, opt)
        info = {"optimizer": _qualname(opt), "trainer": _qualname(trainer), "lr": engine.lr}
    else:
        opt = comera.make_optimizer(model, comera.OptimizerConfig(engine.lr, engine.lr_gates,
                                                                  engine.lr))
        trainer = comera.CoMERATrainer(model, opt, lam=engine.lam,
                                       regularizer=engine.regularizer)
        info = {"optimizer": _qualname(opt), "trainer": _qualname(trainer), "lr": engine.lr,
                "lr_gates": engine.lr_gates, "lam": engine.lam,
                "regularizer": engine.regularizer}
    info.update(size_info(model))
    if hit_shares is not None:
        info["cache_rows"] = bench.cache_rows
        info["cache_hit_percent_per_table"] = hit_shares
    log.info("built %s: %s parameters", name, f"{info['params']:,}")
    return Variant(name, model, opt, trainer, info)


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------


def measure_memory(variant: Variant, batch: Batch) -> dict:
    """Peak memory of one whole step (see ``MEMORY_COUNTED``); runs two steps."""
    return measure_step_memory(variant.model, variant.optimizer, lambda: variant.step(batch),
                               batch.tensors())


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def _load() -> dict:
    """Load average and available memory now: other work on the machine skews timings."""
    available = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    return {"load_average": [round(x, 2) for x in os.getloadavg()],
            "mem_available_bytes": available}


def run_benchmark(bench: BenchConfig) -> dict:
    """Build every variant, time and measure one step of each, return the JSON payload."""
    load_before = _load()
    variants = {}
    for name in bench.variants:
        log.info("building %s", name)
        variants[name] = build_variant(name, bench)
    cfg = bench.model_config("dense")
    batch = make_batch(cfg, bench.batch, bench.seed)
    log.info("timing %s: %d warm-up and %d interleaved steps each", ", ".join(variants),
             bench.warmup, bench.repeats)
    step_fns: dict[str, Callable[[], object]] = {
        n: (lambda v=v: v.step(batch)) for n, v in variants.items()}
    times = interleaved_times(step_fns, bench.repeats, bench.warmup)
    ms = {n: statistics.median(ts) * 1e3 for n, ts in times.items()}
    log.info("measuring memory")
    memory = {n: measure_memory(v, batch) for n, v in variants.items()}
    for v in variants.values():
        v.info["steps_run"] = v.trainer.steps
    payload: dict = {
        "machine": machine(),
        "load": {"before": load_before, "after": _load()},
        "model": asdict(cfg), "bench": asdict(bench),
        "batch": {"size": bench.batch, "unique_ids_per_table": [
            int(torch.unique(batch.sparse[:, k]).numel()) for k in range(cfg.num_tables)],
            "positive_rate": float(batch.labels.mean())},
        "variants": {n: v.info for n, v in variants.items()},
        "memory_counted": MEMORY_COUNTED, "ms": ms, "memory": memory,
        "paper": PAPER_CLAIMS,
    }
    for name in ("tt", "tt_cache"):
        if {"dense", name} <= set(variants):
            dense, tt = variants["dense"].info, variants[name].info
            payload[f"dense_over_{name}"] = {
                "time": ratio(ms["dense"], ms[name]),
                "time_spread": ratio_spread(times["dense"], times[name]),
                "peak_memory": ratio(memory["dense"]["peak_total_bytes"],
                                     memory[name]["peak_total_bytes"]),
                "params": ratio(dense["params"], tt["effective_size"]),
                "table_params": ratio(dense["table_params"], tt["table_params"]),
            }
    return payload


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def render_markdown(payload: dict) -> str:
    """The results as a markdown table, the dense / TT ratios next to the paper's, and notes."""
    m, cfg, bench = payload["machine"], payload["model"], payload["bench"]
    load = payload["load"]
    rows = []
    for name, t in payload["ms"].items():
        mem, info = payload["memory"][name], payload["variants"][name]
        res = mem["resident_bytes"]
        rows.append([name, f"{t:,.1f}", _mib(mem["peak_total_bytes"]), _mib(res["params"]),
                     _mib(mem["grads_bytes"]), _mib(res["optimizer_state"]),
                     _mib(mem["activations_and_temporaries_bytes"]),
                     f"{info['effective_size']:,}", f"{info['table_params']:,}",
                     f"{info['table_compression']:,.1f}x"])
    rows_total = sum(min(c, bench["max_rows"] or c) for c in cfg["cardinalities"])
    f = 1 + len(cfg["cardinalities"])  # the interaction's vectors: bottom output + tables
    bottom = (cfg["num_dense"], *cfg["bottom_mlp"])
    top = (cfg["embedding_dim"] + f * (f - 1) // 2, *cfg["top_mlp"])
    capped = "" if bench["max_rows"] is None else f" (capped at {bench['max_rows']:,} per table)"
    lines = [
        "# DLRM training step (CPU): dense vs TT embedding tables",
        "",
        f"torch {m['torch']}, {m['cpu']}, {m['threads']} threads, commit {m['commit']}, "
        f"{m['date']}. Load average (1, 5, 15 min) {load['before']['load_average']} before, "
        f"{load['after']['load_average']} after: other work shared the machine. Model: "
        f"{len(cfg['cardinalities'])} tables, {rows_total:,} rows{capped}, dim "
        f"{cfg['embedding_dim']}, bottom MLP {'-'.join(map(str, bottom))}, top MLP "
        f"{'-'.join(map(str, top))}; TT rank {cfg['tt_ranks']} on tables of "
        f">= {cfg['tt_min_rows']:,} rows. Batch {bench['batch']} of synthetic Zipf ids. One "
        f"step = forward, BCE loss, backward, AdamW step. Median of {bench['repeats']} "
        f"interleaved repeats after {bench['warmup']} warm-up step(s).",
        "",
        markdown_table(["variant", "ms/step", "peak MiB", "params MiB", "grads MiB",
                        "opt state MiB", "activations + temps MiB", "params (effective)",
                        "table params", "table compression"], rows),
    ]
    if "dense_over_tt_cache" in payload:
        r = payload["dense_over_tt_cache"]
        lines += ["", "## Dense / TT with the hot-row cache", "", markdown_table(
            ["quantity", "measured"],
            [["parameters (whole model)", f"{r['params']:,.1f}x"],
             ["embedding-table parameters", f"{r['table_params']:,.1f}x"],
             ["peak memory of a step", f"{r['peak_memory']:,.2f}x"],
             ["time of a step", spread_text(r["time_spread"])]])]
    if "dense_over_tt" in payload:
        r, paper = payload["dense_over_tt"], payload["paper"]
        lines += ["", "## Dense / TT", "", markdown_table(
            ["quantity", "measured", "paper (Yang et al. 2024)"],
            [["parameters (whole model)", f"{r['params']:,.1f}x",
              f"{paper['compression']:.0f}x"],
             ["embedding-table parameters", f"{r['table_params']:,.1f}x", "-"],
             ["peak memory of a step", f"{r['peak_memory']:,.2f}x",
              f"{paper['peak_memory_reduction']:.0f}x"],
             ["time of a step", spread_text(r["time_spread"]), "-"]]),
            "", "The TT model here is at its initial ranks (the start of CoMERA's early stage); "
            "the paper's 99x is the trained model's. The memory ratio depends on the baseline: "
            "here the dense step holds AdamW moments and a dense gradient for every table row."]
    v = payload["variants"]
    notes = [f"- Memory: {payload['memory_counted']}"]
    if "dense" in v:
        notes.append(f"- dense: nn.Embedding tables with dense gradients, {v['dense']['optimizer']}"
                     f" (lr {v['dense']['lr']}) through {v['dense']['trainer']}.")
    if "tt" in v:
        tt = v["tt"]
        big = tt["largest_tt_table"]
        notes.append(
            f"- tt: {tt['tt_tables']} tables as comera.TTEmbedding at their initial ranks (the "
            f"largest: {big['rows']:,} rows, row modes {big['row_modes']}, col modes "
            f"{big['col_modes']}, bonds {big['bonds']}; the TT tables alone "
            f"{tt['tt_table_compression']:,.0f}x smaller), the rest dense; {tt['optimizer']} "
            f"(comera.make_optimizer, lr {tt['lr']}, gates {tt['lr_gates']}) through "
            f"{tt['trainer']} with the {tt['regularizer']} rank regulariser (lam {tt['lam']}).")
    if "tt_cache" in v:
        c = v["tt_cache"]
        notes.append(f"- tt_cache: tt with {c['cache_rows']:,} dense hot rows per TT table "
                     "(CachedTTEmbedding; the rows count in the sizes), chosen from the "
                     f"ids of {HOT_ROW_SAMPLE:,} training examples; share of that sample's "
                     f"lookups the caches answer, per TT table: "
                     f"{c['cache_hit_percent_per_table']} %.")
    unique = payload["batch"]["unique_ids_per_table"]
    notes.append(f"- Unique ids per table in the batch of {bench['batch']}: {unique}.")
    lines += ["", "## Notes", "", *notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="quickest run: tables capped at 2,000 rows, batch 64, one repeat "
                             "(checks the script, measures nothing)")
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--max-rows", type=int, default=None,
                        help="cap every table at this many rows (default: the full sizes)")
    parser.add_argument("--tt-min-rows", type=int, default=None,
                        help="tables of at least this many rows are TT (default 10,000, or "
                             "--max-rows when smaller)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-rows", type=int, default=1000,
                        help="hot rows per TT table in the tt_cache variant")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    add_out(parser, None, "default dlrm_step_cpu, or dlrm_step_rows<N>_cpu with --max-rows N")
    args = parser.parse_args(argv)
    start_run(parser, args.threads)
    if args.smoke:
        args.batch, args.repeats, args.warmup = 64, 1, 1
        args.max_rows = args.max_rows or 2000
    try:
        bench = BenchConfig(batch=args.batch, repeats=args.repeats, warmup=args.warmup,
                            max_rows=args.max_rows, tt_min_rows=args.tt_min_rows,
                            variants=tuple(dict.fromkeys(args.variants)), seed=args.seed,
                            cache_rows=args.cache_rows)
    except ConfigError as exc:
        parser.error(str(exc))
    payload = run_benchmark(bench)
    markdown = render_markdown(payload)
    out = args.out or ("dlrm_step_cpu" if args.max_rows is None
                       else f"dlrm_step_rows{args.max_rows}_cpu")
    return publish(out, payload, markdown)


if __name__ == "__main__":
    sys.exit(main())
