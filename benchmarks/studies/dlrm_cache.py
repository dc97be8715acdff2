"""DLRM on the quick synthetic Criteo data: dense tables vs plain TT vs TT + hot-row cache, at the
same total table size (the late stage's target counts the cache), over seeds.

    python -m benchmarks.studies.dlrm_cache --seeds 0 1 2 --cache-rows 64

Every variant trains on the engine (:func:`benchmarks.studies.harness.runs.train`) with the
registry's quick ``dlrm`` engine settings (same steps, same data, same split); the TT variants'
late stage lands on ``target_compression`` of their embedding tables, cache included. Results:
``benchmarks/results/dlrm_cache/dlrm_cache.{json,md}``, rewritten after every model (each row
with its curves against step and training wall-clock).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.lib.measure import RESULTS
from benchmarks.studies.harness.results import read_summary, write_summary
from benchmarks.studies.harness.runs import curves, train
from comera.experiments.dlrm_task import DLRMTask, DLRMTaskConfig
from comera.experiments.registry import EXPERIMENTS
from comera.formats.registry import DENSE
from tncomp.files import atomic_write_text

OUT = RESULTS / "dlrm_cache"


def summarise(result: dict) -> str:
    lines = [f"DLRM quick (synthetic Criteo, tables capped at 20,000 rows), target "
             f"{result['settings']['target_compression']:g}x on the TT tables (cache counted); "
             "tt+cacheC: C hot rows per TT table.", "",
             "| variant | seeds | test AUC (mean ± sd) | vs dense | TT-table compression per seed "
             "| table params (mean) |", "|---|---|---|---|---|---|"]
    groups: dict = {}
    for row in result["rows"]:
        groups.setdefault(row["variant"], []).append(row)
    dense = [r["test"]["auc"] for r in groups.get("dense", [])]
    for name, rows in groups.items():
        auc = [r["test"]["auc"] for r in rows]
        sd = statistics.stdev(auc) if len(auc) > 1 else float("nan")
        gap = (f"{100 * (statistics.fmean(auc) - statistics.fmean(dense)):+.2f} pts"
               if dense else "-")
        comp = ", ".join(f"{r['sizes'].get('embedding_compression', 1.0):.1f}x" for r in rows)
        params = [r["table_params"] for r in rows]
        lines.append(f"| {name} | {len(rows)} | {statistics.fmean(auc):.4f} ± {sd:.4f} | {gap} | "
                     f"{comp} | {statistics.fmean(params):,.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--cache-rows", type=int, default=64)
    p.add_argument("--target-compression", type=float, default=99.0)
    p.add_argument("--variants", nargs="+", default=["dense", "tt", "tt+cache"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--append", action="store_true",
                   help="keep the rows already in the results file (more seeds)")
    p.add_argument("--runs", type=Path, default=Path("runs/dlrm_cache"),
                   help="checkpoints (large; not results)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = replace(EXPERIMENTS["dlrm"].quick, target_compression=args.target_compression,
                     threads=args.threads)
    plain = DLRMTask(DLRMTaskConfig.quick(tt_cache_rows=0))
    cached = DLRMTask(replace(plain.cfg, tt_cache_rows=args.cache_rows), plain.data)  # same data
    result = {"settings": {"cache_rows": args.cache_rows, "seeds": args.seeds,
                           "target_compression": args.target_compression,
                           "engine": engine.__dict__}, "rows": []}
    if args.append and (args.out / "dlrm_cache.json").is_file():
        result["rows"] = read_summary(args.out / "dlrm_cache.json")["rows"]
        result["settings"]["seeds"] = sorted({r["seed"] for r in result["rows"]} | set(args.seeds))
    variants = [(f"tt+cache{args.cache_rows}" if name == "tt+cache" else name, task, tt)
                for name, task, tt in (("dense", plain, False), ("tt", plain, True),
                                       ("tt+cache", cached, True)) if name in args.variants]
    for seed in args.seeds:
        config = replace(engine, seed=seed)
        for name, task, tt in variants:
            model, record = train(task, "comera" if tt else "dense", "tt" if tt else DENSE,
                                  config, args.runs / f"{name}-{seed}")
            end = record.stage_ends["late" if tt else "dense"]
            result["rows"].append({"variant": name, "seed": seed, "test": end["test"],
                                   "val": end["val"], "sizes": end["sizes"],
                                   "table_params": model.table_parameters(),
                                   "seconds": round(record.train_seconds, 1),
                                   "curves": curves(record)})
            args.out.mkdir(parents=True, exist_ok=True)
            write_summary(args.out / "dlrm_cache.json", result)
            atomic_write_text(args.out / "dlrm_cache.md", summarise(result) + "\n")
    print(summarise(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
