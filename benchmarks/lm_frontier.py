r"""Four-way compression frontier of the causal language model (issue 23).

    python -m benchmarks.lm_frontier --seeds 0 1 2 --targets 8 --tag t8
    python -m benchmarks.lm_frontier --seeds 0 --targets 4 16 32 --methods fixed lowrank comera \
        --tag rest-s0

Per seed, on the same rows, steps (``early + late``), batch, learning rates and warm-up:

- ``dense``: every block linear layer an ``nn.Linear``;
- ``fixed``: TT layers at the largest uniform TT rank whose linear layers fit the target size,
  trained without gates or pruning (lam 0);
- ``lowrank``: :class:`~comera.layers.lowrank.LowRankLinear` layers at the largest uniform rank
  that fits the same size;
- ``comera``: the TT model at ``--max-rank``, trained ``early`` steps with the early stage
  (loss + lam * R, ``comera.CoMERATrainer``), then copied once per target and trained ``late``
  steps with the late stage toward the target (``comera.LateStage`` with a step budget and
  rounding, fresh optimizer, as ``benchmarks/accuracy_frontier.py``). The early model is kept
  under ``--work`` so later calls with other targets reuse it.

Compression is of the block linear layers (no biases: the model has none there): dense weight
parameters / parameters at the effective ranks. Scores: validation loss and perplexity (the
metric), test loss and perplexity, at the end. Every call writes its rows to
``<out>/runs/<tag>.json`` after every model, then merges every runs file into ``frontier.json``,
``frontier.md`` and ``frontier.png`` (validation loss vs compression), so a cut-off run keeps
what it finished and two calls with different tags can run side by side. ``--smoke``: a tiny
model for a few steps (for tests; pair it with ``--root`` at a small source tree).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

import comera
from benchmarks.lib.harness import RESULTS
from comera.experiments.lm_task import LMTask, LMTaskConfig
from comera.experiments.results import machine
from comera.experiments.task import IndexStream
from comera.layers.linear import TTLinear
from comera.layers.lowrank import LowRankLinear
from comera.ranks.truncate import round_

OUT = RESULTS / "lm_frontier"
METHODS = ("dense", "fixed", "lowrank", "comera")
LABELS = {"dense": "dense", "fixed": "fixed uniform TT rank", "lowrank": "low-rank x@A@B",
          "comera early": "CoMERA early stage", "comera": "CoMERA (early + late)"}


# -- sizes ---------------------------------------------------------------------------------------
def linear_sizes(model: nn.Module) -> tuple[int, int]:
    """(parameters at the effective ranks, dense parameters) of the block linear layers."""
    params = dense = 0
    for _, layer in model.block_linears():
        dense += layer.in_features * layer.out_features + (
            layer.bias.numel() if layer.bias is not None else 0)
        params += (layer.num_parameters() if isinstance(layer, comera.GatedTrain | LowRankLinear)
                   else sum(p.numel() for p in layer.parameters()))
    return params, dense


def layer_ranks(model: nn.Module) -> dict[str, list[int]]:
    """Each compressed block linear layer's ranks (TT: the bonds; low-rank: [r])."""
    out = {}
    for name, layer in model.block_linears():
        if isinstance(layer, comera.GatedTrain):
            out[name] = list(layer.ranks)
        elif isinstance(layer, LowRankLinear):
            out[name] = [layer.rank]
    return out


def _shapes(task: LMTask) -> list[tuple[int, int]]:
    c = task.config
    return [(c.d_model, c.d_model)] * 4 * c.n_layers + [(c.d_model, c.d_ff),
                                                       (c.d_ff, c.d_model)] * c.n_layers


def uniform_rank(task: LMTask, kind: str, target: float) -> int:
    """The largest uniform rank of ``kind`` ("tt" or "lowrank") whose block linear layers hold
    at most dense / ``target`` parameters (rank 1 if even that is above)."""
    shapes = _shapes(task)
    budget = sum(i * o for i, o in shapes) / target
    sizes: dict[tuple[int, int, int], int] = {}

    def size(r: int) -> int:
        if kind == "lowrank":
            return sum(min(r, i, o) * (i + o) for i, o in shapes)
        for i, o in set(shapes):
            if (i, o, r) not in sizes:
                sizes[i, o, r] = TTLinear(i, o, ranks=r, bias=False).num_parameters()
        return sum(sizes[i, o, r] for i, o in shapes)

    best, previous = 1, -1
    for r in range(1, max(max(i, o) for i, o in shapes) + 1):
        now = size(r)
        if now > budget or now == previous:  # over budget, or every bond at its maximum
            break
        best, previous = r, now
    return best


# -- training ------------------------------------------------------------------------------------
def _train(task: LMTask, model, trainer, stream: IndexStream, first: int, steps: int,
           warmup: int, base: dict) -> None:
    model.train()
    for step in range(first, first + steps):
        factor = min(1.0, (step + 1) / warmup) if warmup else 1.0
        for group in trainer.optimizer.param_groups:
            group["lr"] = base[group.get("name", "other")] * factor
        trainer.step(task.loss(model, task.batch(stream.indices(step))))


def _score(task: LMTask, model: nn.Module) -> dict:
    model.eval()
    with torch.no_grad():
        val, test = task.evaluate(model, "val"), task.evaluate(model, "test")
    model.train()
    params, dense = linear_sizes(model)
    return {"val": val, "test": test, "linear_params": params, "linear_dense": dense,
            "compression": dense / max(params, 1), "ranks": layer_ranks(model)}


def _tt_trainer(model, args, lam: float):
    return comera.CoMERATrainer(model, comera.make_optimizer(
        model, comera.OptimizerConfig(args.lr, args.lr_gates, args.lr)), lam, max_grad_norm=1.0)


def _early_key(args, seed: int) -> str:
    parts = (seed, args.early, args.batch, args.lr, args.lr_gates, args.lam, args.warmup,
             args.max_rank, args.smoke, str(args.root))
    return "early-" + "-".join(str(p).replace("/", "_") for p in parts) + ".pt"


def run(args, task: LMTask, rows: list, save) -> None:
    base = {"cores": args.lr, "gates": args.lr_gates, "other": args.lr}
    total = args.early + args.late

    def add(seed, method, target, start, model, **extra):
        rows.append({"seed": seed, "method": method, "target": target,
                     "seconds": round(time.time() - start, 1), **extra, **_score(task, model)})
        save()
        r = rows[-1]
        print(f"seed {seed} {method} {target}: val loss {r['val']['loss']:.4f} "
              f"({r['compression']:.1f}x, {r['seconds']:.0f}s)", flush=True)

    for seed in args.seeds:
        stream = IndexStream(task.train_size(), args.batch, seed)
        if "dense" in args.methods:
            torch.manual_seed(seed)
            model = task.build("dense")
            opt = torch.optim.AdamW([{"params": list(model.parameters()), "lr": args.lr,
                                      "name": "other"}], weight_decay=0.0)
            start = time.time()
            _train(task, model, comera.DenseTrainer(model, opt, 1.0), stream, 0, total,
                   args.warmup, base)
            add(seed, "dense", None, start, model)
        early = None
        if "comera" in args.methods:
            path = args.work / _early_key(args, seed)
            start = time.time()
            if path.is_file():
                early = torch.load(path, weights_only=False)
            else:
                torch.manual_seed(seed)
                early = task.build("tt", args.max_rank)
                _train(task, early, _tt_trainer(early, args, args.lam), stream, 0, args.early,
                       args.warmup, base)
                round_(early)  # exact: frees slices a rank-1 neighbour makes useless
                args.work.mkdir(parents=True, exist_ok=True)
                torch.save(early, path)
                add(seed, "comera early", None, start, early)
        for target in args.targets:
            if "comera" in args.methods:
                model = copy.deepcopy(early)
                trainer = _tt_trainer(model, args, 0.0)
                params, dense = linear_sizes(model)
                non_linear = comera.model_size(model) - params
                trainer.start_late_stage(comera.LateStage(dense / target + non_linear,
                                                          steps=args.late, rounding=True))
                start = time.time()
                _train(task, model, trainer, stream, args.early, args.late, 1, base)
                add(seed, "comera", target, start, model)
            if "fixed" in args.methods:
                rank = uniform_rank(task, "tt", target)
                torch.manual_seed(seed)
                model = task.build("tt", rank)
                start = time.time()
                _train(task, model, _tt_trainer(model, args, 0.0), stream, 0, total,
                       args.warmup, base)
                add(seed, "fixed", target, start, model, rank=rank)
            if "lowrank" in args.methods:
                rank = uniform_rank(task, "lowrank", target)
                torch.manual_seed(seed)
                model = task.build("lowrank", rank)
                opt = torch.optim.AdamW([{"params": list(model.parameters()), "lr": args.lr,
                                          "name": "other"}], weight_decay=0.0)
                start = time.time()
                _train(task, model, comera.DenseTrainer(model, opt, 1.0), stream, 0, total,
                       args.warmup, base)
                add(seed, "lowrank", target, start, model, rank=rank)


# -- reporting -----------------------------------------------------------------------------------
def merge(out: Path) -> dict:
    """Every runs/*.json under ``out`` in one result (rows concatenated, settings per run)."""
    runs = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    rows = [row for r in runs for row in r["rows"]]
    return {"task": "causal LM on CPython stdlib sources", "data": runs[0]["data"] if runs else {},
            "runs": [{k: v for k, v in r.items() if k != "rows"} for r in runs], "rows": rows}


def _mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else float("nan")
    return f"{statistics.fmean(values):.4f} ± {sd:.4f}"


def summarise(result: dict) -> str:
    data = result["data"]
    lines = [f"Causal LM on CPython stdlib sources: train {data.get('train')} rows, val "
             f"{data.get('val')}, test {data.get('test')} (of {data.get('seq_len')} tokens, "
             f"split by module); vocabulary {data.get('vocab')}.", "",
             "| target | method | seeds | val loss (mean ± sd) | val ppl | vs dense | test loss "
             "| linear compression | uniform rank |", "|---|---|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for row in result["rows"]:
        groups.setdefault((row["target"], row["method"]), []).append(row)
    dense = [r["val"]["loss"] for r in result["rows"] if r["method"] == "dense"]
    dense_mean = statistics.fmean(dense) if dense else float("nan")
    order = {m: k for k, m in enumerate(("dense", "comera early", *METHODS[1:]))}
    for (target, method), rows in sorted(groups.items(), key=lambda kv: (
            kv[0][0] or 0, order.get(kv[0][1], 9))):
        val = [r["val"]["loss"] for r in rows]
        ppl = statistics.fmean(r["val"]["perplexity"] for r in rows)
        test = [r["test"]["loss"] for r in rows]
        comp = statistics.fmean(r["compression"] for r in rows)
        rank = sorted({r["rank"] for r in rows if "rank" in r})
        rel = statistics.fmean(val) / dense_mean - 1
        lines.append(f"| {f'{target:g}x' if target else '-'} | {LABELS.get(method, method)} | "
                     f"{len(rows)} (seeds {','.join(str(r['seed']) for r in rows)}) | "
                     f"{_mean_sd(val)} | {ppl:.1f} | {rel:+.2%} | {_mean_sd(test)} | "
                     f"{comp:.1f}x | {','.join(map(str, rank)) or '-'} |")
    lines += ["", "CoMERA's per-layer TT ranks (interior bonds) at each target, first seed, "
              "next to the fixed uniform rank:", ""]
    seen = set()
    for row in sorted(result["rows"], key=lambda r: r["target"] or 0):
        if row["method"] == "comera" and row["target"] not in seen:
            seen.add(row["target"])
            fixed = [r.get("rank") for r in result["rows"]
                     if r["method"] == "fixed" and r["target"] == row["target"]]
            lines.append(f"- {row['target']:g}x (seed {row['seed']}, uniform TT rank "
                         f"{fixed[0] if fixed else '?'}): " + "; ".join(
                             f"{n}: {r[1:-1]}" for n, r in row["ranks"].items()))
    if result["runs"]:
        m = result["runs"][-1]["machine"]
        lines += ["", f"Machine: {m['cpu']}, torch {m['torch']}, {m['threads']} thread(s); "
                  "commands:", ""] + [f"    {r['command']}" for r in result["runs"]]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> bool:
    """Validation loss vs compression, one point per seed; False when matplotlib is absent."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    dense = [r["val"]["loss"] for r in result["rows"] if r["method"] == "dense"]
    if dense:
        mean = statistics.fmean(dense)
        sd = statistics.stdev(dense) if len(dense) > 1 else 0.0
        ax.axhline(mean, color="k", lw=1, label=f"dense (mean of {len(dense)})")
        ax.axhspan(mean - sd, mean + sd, color="k", alpha=0.1)
        ax.axhline(mean * 1.03, color="k", lw=0.8, ls=":", label="dense + 3%")
    for method, marker in (("fixed", "^"), ("lowrank", "v"), ("comera", "o"),
                           ("comera early", "s")):
        rows = [r for r in result["rows"] if r["method"] == method]
        if rows:
            ax.scatter([r["compression"] for r in rows], [r["val"]["loss"] for r in rows],
                       marker=marker, label=LABELS[method], alpha=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("compression of the block linear layers (dense / compressed parameters)")
    ax.set_ylabel("validation loss (next-token cross-entropy)")
    ax.set_title("Causal LM: validation loss vs compression (one point per seed)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(out: Path) -> dict:
    result = merge(out)
    _atomic_write(out / "frontier.json", json.dumps(result, indent=1, default=str))
    _atomic_write(out / "frontier.md", summarise(result) + "\n")
    plot(result, out / "frontier.png")
    return result


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--targets", type=float, nargs="+", default=[8, 4, 16, 32])
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--early", type=int, default=300)
    p.add_argument("--late", type=int, default=150)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--lr-gates", type=float, default=1e-2)
    p.add_argument("--lam", type=float, default=0.02)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--max-rank", type=int, default=32, help="CoMERA's starting TT rank")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--root", type=Path, default=None,
                   help="a folder of .py files to read instead of the standard library")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny model (d_model 16, 1 block, 16 tokens) for a fast test")
    p.add_argument("--tag", default="run", help="this call's rows go to <out>/runs/<tag>.json")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--work", type=Path, default=Path("/tmp/lm_frontier_work"),
                   help="where early-stage models are kept for later targets")
    p.add_argument("--summarise-only", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.early, args.late = min(args.early, 4), min(args.late, 3)
    return args


def task_config(args) -> LMTaskConfig:
    if args.smoke:
        return replace(LMTaskConfig(), seq_len=16, vocab_size=64, d_model=16, n_heads=2,
                       d_ff=32, n_layers=1, rank=args.max_rank, eval_limit=8)
    return replace(LMTaskConfig(), rank=args.max_rank)


def main(argv=None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    if not args.summarise_only:
        task = LMTask(task_config(args), root=args.root)
        own = args.out / "runs" / f"{args.tag}.json"
        own.parent.mkdir(parents=True, exist_ok=True)
        payload = {"tag": args.tag, "data": task.describe(), "machine": machine(),
                   "command": "python -m benchmarks.lm_frontier " + shlex.join(
                       sys.argv[1:] if argv is None else argv),
                   "settings": {k: str(v) if isinstance(v, Path) else v
                                for k, v in vars(args).items()}, "rows": []}

        def save() -> None:
            _atomic_write(own, json.dumps(payload, indent=1, default=str))
            write_report(args.out)

        run(args, task, payload["rows"], save)
        save()
    print(summarise(write_report(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
