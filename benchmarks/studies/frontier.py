r"""The four-way compression frontier shared by the language-model tasks (issue 23): dense, a
fixed uniform TT rank, plain low-rank factors and CoMERA, at matched size of the block linear
layers, on the same rows, steps, batches, seeds, learning rates and warm-up.

A task script (``benchmarks/studies/lm_frontier.py``, ``benchmarks/studies/mlm_frontier.py``)
gives a :class:`Spec`; this module trains, scores, merges and reports. The task object must offer
``build(kind, rank)`` (kind "dense", "tt" or "lowrank"), ``block_linears(model)``,
``step_batch(stream, step)``, ``loss``, ``evaluate(model, split)`` (a dict with "loss" and
"perplexity"), ``describe()`` and ``train_size()``.

Methods, per seed and target:

- ``dense``: every block linear layer an ``nn.Linear``, all ``early + late`` steps;
- ``fixed``: TT layers at the largest uniform TT rank whose block linear layers fit the
  target size, trained without gates or pruning (lam 0), all steps;
- ``lowrank``: :class:`~comera.layers.lowrank.LowRankLinear` layers at the largest uniform rank
  that fits the same size, all steps;
- ``comera``: the TT model at ``--max-rank``, ``early`` steps of the early stage (loss + lam *
  R), then per target ``late`` steps of the late stage (``comera.LateStage`` with a step budget
  and rounding, fresh optimizer). The early model is kept under ``--work`` for later calls;
- ``spectrum``: the TT model at ``--max-rank`` trained ``--decide`` steps (lam 0), then per
  target the spectrum allocation (:func:`comera.ranks.allocate.allocate`: every bond's singular
  values, the budget spent on the slices of most energy per parameter, from the uniform
  allocation up) and a fresh model at the chosen ranks trained all steps, as the fixed rank is.

Compression: dense parameters / parameters at the effective ranks of the block linear layers
(biases included where the model has them). Every call writes its rows to
``<out>/runs/<tag>.json`` after every model, then merges every runs file into
``frontier.json``, ``frontier.md`` and ``frontier.png``, so a cut-off run keeps what it
finished and calls with different tags can run side by side.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import comera
from comera.experiments.results import machine
from comera.experiments.task import IndexStream
from comera.layers.lowrank import LowRankLinear
from comera.ranks import budget
from comera.ranks.allocate import FLOORS, allocate, rebuild_at_
from comera.ranks.truncate import round_

METHODS = ("dense", "fixed", "lowrank", "comera", "spectrum")
LABELS = {"dense": "dense", "fixed": "fixed uniform TT rank", "lowrank": "low-rank x@A@B",
          "comera early": "CoMERA early stage", "comera": "CoMERA (early + late)",
          "spectrum": "CoMERA (spectrum allocation, restart)"}
_ORDER = ("dense", "comera early", "fixed", "lowrank", "comera", "spectrum")


@dataclass(frozen=True)
class Spec:
    """What a task's frontier script fixes: its name, title, results folder, task factory
    (from the parsed arguments) and the defaults of its quick engine settings."""

    name: str
    title: str
    out: Path
    make_task: Callable[[argparse.Namespace], Any]
    defaults: dict[str, Any] = field(default_factory=dict)
    split: str = "val"  # the split the plot and the "vs dense" column lead with


# -- sizes ---------------------------------------------------------------------------------------
def linear_sizes(task, model: nn.Module) -> tuple[int, int]:
    """(parameters at the effective ranks, dense parameters) of the block linear layers,
    biases included."""
    params = dense = 0
    for _, layer in task.block_linears(model):
        if isinstance(layer, comera.GatedLayer | LowRankLinear):
            params += layer.num_parameters()
            dense += layer.dense_num_parameters()
        else:
            n = sum(p.numel() for p in layer.parameters())
            params += n
            dense += n
    return params, dense


def layer_ranks(task, model: nn.Module) -> dict[str, list[int]]:
    """Each compressed block linear layer's ranks (TT: the bonds, ends included; low-rank:
    [r])."""
    out = {}
    for name, layer in task.block_linears(model):
        if isinstance(layer, comera.GatedLayer):
            out[name] = list(layer.ranks)
        elif isinstance(layer, LowRankLinear):
            out[name] = [layer.rank]
    return out


def uniform_rank(task, kind: str, target: float) -> int:
    """The largest uniform rank of ``kind`` ("tt" or "lowrank") whose block linear layers hold
    at most dense / ``target`` parameters (rank 1 if even that is above)."""
    torch.manual_seed(0)
    shapes = [(m.in_features, m.out_features, m.bias is not None)
              for _, m in task.block_linears(task.build("dense"))]
    return max(1, budget.uniform_rank(kind, shapes, budget.dense_linear_size(shapes) / target))


# -- training ------------------------------------------------------------------------------------
def _train(task, model, trainer, stream: IndexStream, first: int, steps: int, warmup: int,
           base: dict) -> None:
    model.train()
    for step in range(first, first + steps):
        factor = min(1.0, (step + 1) / warmup) if warmup else 1.0
        for group in trainer.optimizer.param_groups:
            group["lr"] = base[group.get("name", "other")] * factor
        trainer.step(task.loss(model, task.step_batch(stream, step)))


def _score(task, model: nn.Module) -> dict:
    model.eval()
    with torch.no_grad():
        val, test = task.evaluate(model, "val"), task.evaluate(model, "test")
    model.train()
    params, dense = linear_sizes(task, model)
    return {"val": val, "test": test, "linear_params": params, "linear_dense": dense,
            "compression": dense / max(params, 1), "ranks": layer_ranks(task, model)}


def _tt_trainer(model, args, lam: float):
    return comera.CoMERATrainer(model, comera.make_optimizer(
        model, comera.OptimizerConfig(args.lr, args.lr_gates, args.lr)), lam, max_grad_norm=1.0)


def _dense_trainer(model, args):
    opt = torch.optim.AdamW([{"params": list(model.parameters()), "lr": args.lr,
                              "name": "other"}], weight_decay=0.0)
    return comera.DenseTrainer(model, opt, 1.0)


def _early_key(spec: Spec, args, seed: int) -> str:
    parts = (spec.name, seed, args.early, args.batch, args.lr, args.lr_gates, args.lam,
             args.warmup, args.max_rank, args.smoke, str(args.root))
    return "early-" + "-".join(str(p).replace("/", "_") for p in parts) + ".pt"


def run(spec: Spec, args, task, rows: list, save: Callable[[], None]) -> None:
    """Train and score every (seed, method, target) of ``args``, appending rows."""
    base = {"cores": args.lr, "gates": args.lr_gates, "other": args.lr}
    total = args.early + args.late

    def add(seed, method, target, start, model, **extra):
        rows.append({"seed": seed, "method": method, "target": target,
                     "seconds": round(time.time() - start, 1), **extra, **_score(task, model)})
        save()
        r = rows[-1]
        print(f"seed {seed} {method} {target}: val loss {r['val']['loss']:.4f}, test loss "
              f"{r['test']['loss']:.4f} ({r['compression']:.1f}x, {r['seconds']:.0f}s)",
              flush=True)

    def sizes_of(model, target):
        params, dense = linear_sizes(task, model)
        return dense / target + comera.model_size(model) - params  # whole-model budget

    for seed in args.seeds:
        stream = IndexStream(task.train_size(), args.batch, seed)
        if "dense" in args.methods:
            torch.manual_seed(seed)
            model = task.build("dense")
            start = time.time()
            _train(task, model, _dense_trainer(model, args), stream, 0, total, args.warmup, base)
            add(seed, "dense", None, start, model)
        early = None
        if "comera" in args.methods:
            path = args.work / _early_key(spec, args, seed)
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
        probe = None
        if "spectrum" in args.methods:
            torch.manual_seed(seed)
            probe = task.build("tt", args.max_rank)
            decide_start = time.time()
            _train(task, probe, _tt_trainer(probe, args, 0.0), stream, 0, args.decide,
                   args.warmup, base)
            decide_seconds = time.time() - decide_start
        for target in args.targets:
            if "comera" in args.methods:
                model = copy.deepcopy(early)
                trainer = _tt_trainer(model, args, 0.0)
                trainer.start_late_stage(comera.LateStage(sizes_of(model, target),
                                                          steps=args.late, rounding=True))
                start = time.time()
                _train(task, model, trainer, stream, args.early, args.late, 1, base)
                add(seed, "comera", target, start, model)
            if "spectrum" in args.methods:
                start = time.time() - decide_seconds
                chosen = allocate(probe, sizes_of(probe, target), args.floor)
                torch.manual_seed(seed)
                model = rebuild_at_(task.build("tt", args.max_rank), chosen.ranks)
                _train(task, model, _tt_trainer(model, args, 0.0), stream, 0, total,
                       args.warmup, base)
                add(seed, "spectrum", target, start, model, decide=args.decide,
                    floor=args.floor, uniform_rank=chosen.uniform_rank)
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
                start = time.time()
                _train(task, model, _dense_trainer(model, args), stream, 0, total, args.warmup,
                       base)
                add(seed, "lowrank", target, start, model, rank=rank)


# -- reporting -----------------------------------------------------------------------------------
def mean_sd(values: list[float], digits: int = 4) -> str:
    """``mean ± sd`` of ``values`` (sd nan for one value)."""
    sd = statistics.stdev(values) if len(values) > 1 else float("nan")
    return f"{statistics.fmean(values):.{digits}f} ± {sd:.{digits}f}"


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def merge(spec: Spec, out: Path) -> dict:
    """Every runs/*.json under ``out`` in one result (rows concatenated, settings per run)."""
    runs = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    rows = [row for r in runs for row in r["rows"]]
    return {"task": spec.title, "data": runs[0]["data"] if runs else {},
            "runs": [{k: v for k, v in r.items() if k != "rows"} for r in runs], "rows": rows}


def summarise(spec: Spec, result: dict) -> str:
    """The frontier table (mean ± sd over seeds per method and target), CoMERA's per-layer
    ranks next to the uniform rank, the machine and the commands."""
    data = result["data"]
    lines = [f"{spec.title}: train {data.get('train')} rows, val {data.get('val')}, test "
             f"{data.get('test')} (of {data.get('seq_len')} tokens, split by module); "
             f"vocabulary {data.get('vocab')}.", "",
             "| target | method | seeds | val loss (mean ± sd) | val ppl | val vs dense "
             "| test loss (mean ± sd) | test vs dense | linear compression | uniform rank |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for row in result["rows"]:
        groups.setdefault((row["target"], row["method"]), []).append(row)
    dense = {s: statistics.fmean(r[s]["loss"] for r in result["rows"] if r["method"] == "dense")
             if any(r["method"] == "dense" for r in result["rows"]) else float("nan")
             for s in ("val", "test")}
    order = {m: k for k, m in enumerate(_ORDER)}
    for (target, method), rows in sorted(groups.items(), key=lambda kv: (
            kv[0][0] or 0, order.get(kv[0][1], 9))):
        val = [r["val"]["loss"] for r in rows]
        test = [r["test"]["loss"] for r in rows]
        ppl = statistics.fmean(r["val"]["perplexity"] for r in rows)
        comp = statistics.fmean(r["compression"] for r in rows)
        rank = sorted({r["rank"] for r in rows if "rank" in r})
        lines.append(
            f"| {f'{target:g}x' if target else '-'} | {LABELS.get(method, method)} | "
            f"{len(rows)} (seeds {','.join(str(r['seed']) for r in rows)}) | {mean_sd(val)} | "
            f"{ppl:.1f} | {statistics.fmean(val) / dense['val'] - 1:+.2%} | {mean_sd(test)} | "
            f"{statistics.fmean(test) / dense['test'] - 1:+.2%} | {comp:.1f}x | "
            f"{','.join(map(str, rank)) or '-'} |")
    for method in ("comera", "spectrum"):
        chosen = sorted((r for r in result["rows"] if r["method"] == method),
                        key=lambda r: (r["target"], r["seed"]))
        if not chosen:
            continue
        lines += ["", f"{LABELS[method]}: per-layer TT ranks (interior bonds) at each target, "
                  "first seed, next to the fixed uniform rank:", ""]
        seen = set()
        for row in chosen:
            if row["target"] in seen:
                continue
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


def plot_points(series: dict[str, list[tuple[float, float]]], path: Path, *, title: str,
                xlabel: str, ylabel: str, reference: tuple[str, list[float]] | None = None,
                lines: tuple[tuple[str, float], ...] = ()) -> bool:
    """A log-x scatter of (x, y) points per labelled series, with an optional reference band
    (label, values: mean line and ± sd band) and horizontal lines; False without
    matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = iter(("^", "v", "o", "s", "x", "D", "P"))
    fig, ax = plt.subplots(figsize=(6.6, 4.3))
    if reference and reference[1]:
        label, values = reference
        mean = statistics.fmean(values)
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        ax.axhline(mean, color="k", lw=1, label=f"{label} (mean ± sd of {len(values)})")
        ax.axhspan(mean - sd, mean + sd, color="k", alpha=0.1)
    for label, y in lines:
        ax.axhline(y, color="grey", lw=0.8, ls=":", label=label)
    for label, points in series.items():
        if points:
            ax.scatter([p[0] for p in points], [p[1] for p in points], marker=next(markers),
                       label=label, alpha=0.8)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot(spec: Spec, result: dict, path: Path) -> bool:
    """Loss on ``spec.split`` vs compression, one point per seed."""
    rows, split = result["rows"], spec.split
    dense = [r[split]["loss"] for r in rows if r["method"] == "dense"]
    target = ()
    if dense:
        pct = 3 if spec.name == "lm" else 5
        target = ((f"dense + {pct}%", statistics.fmean(dense) * (1 + pct / 100)),)
    series = {LABELS[m]: [(r["compression"], r[split]["loss"]) for r in rows if r["method"] == m]
              for m in _ORDER[1:]}
    return plot_points(series, path, title=f"{spec.title}\n{split} loss vs compression "
                       "(one point per seed)",
                       xlabel="compression of the block linear layers (dense / parameters)",
                       ylabel=f"{split} loss (cross-entropy)", reference=("dense", dense),
                       lines=target)


def write_report(spec: Spec, out: Path) -> dict:
    result = merge(spec, out)
    atomic_write(out / "frontier.json", json.dumps(result, indent=1, default=str))
    atomic_write(out / "frontier.md", summarise(spec, result) + "\n")
    plot(spec, result, out / "frontier.png")
    return result


def parse(spec: Spec, argv=None, doc: str | None = None) -> argparse.Namespace:
    d = {"early": 300, "late": 150, "batch": 16, "lr": 2e-3, "lr_gates": 1e-2, "lam": 0.02,
         "warmup": 50, "max_rank": 32, "decide": 112, "targets": [8, 4, 16, 32]} | spec.defaults
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--targets", type=float, nargs="+", default=d["targets"])
    p.add_argument("--methods", nargs="+", choices=METHODS,
                   default=["dense", "fixed", "lowrank", "comera"])
    p.add_argument("--early", type=int, default=d["early"])
    p.add_argument("--late", type=int, default=d["late"])
    p.add_argument("--decide", type=int, default=d["decide"],
                   help="spectrum: steps at --max-rank before the allocation fixes the shape")
    p.add_argument("--floor", choices=FLOORS, default="uniform",
                   help="spectrum: the allocation starts from the uniform ranks or from rank 1")
    p.add_argument("--batch", type=int, default=d["batch"])
    p.add_argument("--lr", type=float, default=d["lr"])
    p.add_argument("--lr-gates", type=float, default=d["lr_gates"])
    p.add_argument("--lam", type=float, default=d["lam"])
    p.add_argument("--warmup", type=int, default=d["warmup"])
    p.add_argument("--max-rank", type=int, default=d["max_rank"],
                   help="CoMERA's starting TT rank")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--root", type=Path, default=None,
                   help="a folder of .py files to read instead of the standard library")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny model (d_model 16, 1 block, 16 tokens) for a fast test")
    p.add_argument("--tag", default="run", help="this call's rows go to <out>/runs/<tag>.json")
    p.add_argument("--out", type=Path, default=spec.out)
    p.add_argument("--work", type=Path, default=Path(f"/tmp/{spec.name}_frontier_work"),
                   help="where early-stage models are kept for later targets")
    p.add_argument("--summarise-only", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.early, args.late = min(args.early, 4), min(args.late, 3)
        args.decide = min(args.decide, 2)
    if not 0 < args.decide < args.early + args.late:
        p.error(f"--decide {args.decide}: give a step count in (0, early + late)")
    return args


def main(spec: Spec, argv=None, doc: str | None = None) -> int:
    """Parse, train (unless ``--summarise-only``), write the runs file and the report."""
    args = parse(spec, argv, doc)
    torch.set_num_threads(args.threads)
    if not args.summarise_only:
        task = spec.make_task(args)
        own = args.out / "runs" / f"{args.tag}.json"
        own.parent.mkdir(parents=True, exist_ok=True)
        payload = {"tag": args.tag, "data": task.describe(), "machine": machine(),
                   "command": f"python -m benchmarks.{spec.name}_frontier " + shlex.join(
                       sys.argv[1:] if argv is None else argv),
                   "settings": {k: str(v) if isinstance(v, Path) else v
                                for k, v in vars(args).items()}, "rows": []}

        def save() -> None:
            atomic_write(own, json.dumps(payload, indent=1, default=str))
            write_report(spec, args.out)

        run(spec, args, task, payload["rows"], save)
        save()
    print(summarise(spec, write_report(spec, args.out)))
    return 0
