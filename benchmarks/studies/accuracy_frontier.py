r"""The four-way compression/accuracy frontier on the reviews task: dense, a fixed uniform TT
rank, plain low-rank factors and CoMERA, at matched sizes, on the same data, steps and seeds.

    python -m benchmarks.studies.accuracy_frontier --seeds 0 1 2 --targets 10 30 50 100 130

Per seed, every model trains ``--steps`` steps on the same batches (:class:`IndexStream`), with
the same AdamW learning rates (``--lr`` for weights, ``--lr-gates`` for the TT gates) and the
same schedule (linear warm-up over ``--warmup`` steps, then constant):

- ``dense``: the model with dense linear layers.
- ``fixed``: per target, the largest uniform TT rank whose linear layers fit the target size
  (:func:`comera.ranks.allocate.uniform_ranks`), trained at that shape without pruning (each
  rank is trained once per seed and reported at every target it serves).
- ``lowrank``: per target, every linear layer as ``x @ A @ B`` (:class:`LowRankLinear`) at the
  largest uniform rank fitting the same size; targets where rank 1 does not fit have no row.
- ``comera``: rank 16 trained for ``--decide`` steps, then per target the late stage with the
  spectrum allocation (``LateStage(allocation="spectrum")``: the budget spent on the slices of
  most energy per parameter, from the uniform allocation up; :mod:`comera.ranks.allocate`),
  which fixes the shape at once; the final shape trains for the remaining steps.
- ``early`` (optional): the early stage alone, with a size target
  (:class:`comera.training.early.EarlyStage` at the target, step budget ``--steps``, landing
  ``--early-landing``): rank 16, lam ``--lam`` adapted toward the size schedule, off at the
  target; all ``--steps`` steps.
- ``prune`` (optional): the earlier CoMERA schedule, an early stage of ``--early`` steps (lam
  ``--lam``) then the late stage pruning to each target over the remaining steps
  (``LateStage(allocation="prune")``).

Test accuracy (and validation accuracy) is scored at the end of each. Sizes count the linear
layers (biases included), the size the targets speak of. Results go to ``--out``
(``frontier.json``, rewritten after every model so a cut-off run keeps what it finished;
``frontier.md``: mean ± sd per method and target, and CoMERA's per-layer ranks next to the
uniform ones; ``frontier.png``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

import comera
from benchmarks.lib.harness import RESULTS
from benchmarks.studies.frontier import atomic_write, mean_sd
from comera.experiments.results import machine
from comera.experiments.task import IndexStream
from comera.experiments.transformer_task import ReviewsTask, ReviewsTaskConfig
from comera.layers.lowrank import LowRankLinear
from comera.models import PairClassifier, TransformerConfig
from comera.ranks.allocate import rebuild_at_, uniform_ranks
from comera.ranks.truncate import round_
from comera.training.early import EarlyStage

OUT = RESULTS / "reviews_frontier"
METHODS = ("dense", "fixed", "lowrank", "comera", "early", "prune")
ROWS = ("dense", "fixed", "lowrank", "comera", "comera-warm", "early",
        "prune")  # the names rows carry
LABELS = {"dense": "dense", "fixed": "fixed uniform TT rank", "lowrank": "low-rank x @ A @ B",
          "comera": "CoMERA", "comera-warm": "CoMERA, warm (no restart)",
          "early": "CoMERA early stage to the target", "prune": "CoMERA (prune)"}


class SmallReviews(ReviewsTask):
    """The reviews task on a d_model-128 encoder (2 layers, FFN 512), CPU-minutes per model.
    The token table stays dense, so the TT layers (and the late stage's targets) are exactly the
    linear layers: the compression the targets speak of."""

    def model_config(self, tt: bool) -> TransformerConfig:
        base = super().model_config(tt)
        return replace(base, d_model=128, n_heads=4, d_ff=512, rank=16, tt_embedding=False,
                       attn_modes=None, ffn_in_modes=None, ffn_out_modes=None)


def _lr(step: int, warmup: int) -> float:
    return min(1.0, (step + 1) / warmup)


def _train(task, model, trainer, stream, first: int, steps: int, warmup: int, base: dict):
    model.train()
    for step in range(first, first + steps):
        for group in trainer.optimizer.param_groups:
            group["lr"] = base[group.get("name", "other")] * _lr(step, warmup)
        trainer.step(task.loss(model, task.batch(stream.indices(step))))


def linear_sizes(model: nn.Module) -> tuple[int, int]:
    """(parameters, dense parameters) of the compressible linear layers: TT linear layers at
    their effective ranks, low-rank layers, or (dense model) the encoder's nn.Linear layers."""
    tt = [m for _, m in comera.gated_layers(model)]
    low = [m for m in model.modules() if isinstance(m, LowRankLinear)]
    if tt or low:
        return (sum(m.num_parameters() for m in tt + low),
                sum(m.dense_num_parameters() for m in tt + low))
    dense = sum(m.weight.numel() + m.bias.numel() for n, m in model.named_modules()
                if isinstance(m, nn.Linear) and n.startswith("blocks."))
    return dense, dense


def _score(task, model) -> dict:
    model.eval()
    with torch.no_grad():
        test = task.evaluate(model, "test")
        val = task.evaluate(model, "val")
    model.train()
    params, dense = linear_sizes(model)
    ranks = {n: list(m.ranks) for n, m in comera.gated_layers(model)}
    ranks |= {n: [m.rank] for n, m in model.named_modules() if isinstance(m, LowRankLinear)}
    return {"test": test, "val": val, "linear_params": params, "linear_dense": dense,
            "linear_compression": dense / max(params, 1), "ranks": ranks}


def _lowrank_model(task, rank: int) -> nn.Module:
    """The dense model with every encoder linear layer as a rank-``rank`` LowRankLinear."""
    model = task.build_model(tt=False)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name.startswith("blocks."):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child,
                    LowRankLinear(module.in_features, module.out_features, rank))
    return model


def _lowrank_rank(task, budget: float) -> int:
    """The largest uniform low-rank whose linear layers fit ``budget`` (0: not even rank 1)."""
    best = 0
    for rank in range(1, 129):
        if linear_sizes(_lowrank_model(task, rank))[0] <= budget:
            best = rank
    return best


def _shaped_model(task, seed: int, ranks: dict) -> nn.Module:
    """A fresh TT model (initialised from ``seed`` as the fixed-rank one is) whose TT layers
    have the bonds ``ranks`` (per layer name, ends included)."""
    torch.manual_seed(seed)
    model = PairClassifier(replace(task.model_config(True),
                                   rank=max(max(r) for r in ranks.values())))
    return rebuild_at_(model, ranks)


def _tt_optimizer(model, args):
    return comera.make_optimizer(model, comera.OptimizerConfig(args.lr, args.lr_gates, args.lr))


def run(args) -> dict:
    task = SmallReviews(ReviewsTaskConfig(max_len=args.max_len))
    result = {"task": "reviews (title, review) -> recommended", "data": task.describe(),
              "settings": vars(args) | {"out": str(args.out)}, "machine": machine(),
              "rows": []}
    if args.append and (args.out / "frontier.json").is_file():
        result["rows"] = json.loads((args.out / "frontier.json").read_text())["rows"]
    lr = {"cores": args.lr, "gates": args.lr_gates, "other": args.lr}
    torch.manual_seed(0)
    probe = task.build_model(tt=True)
    dense_linear = linear_sizes(probe)[1]
    budgets = {t: dense_linear / t for t in args.targets}  # linear-layer parameters per target
    other = comera.model_size(probe) - comera.model_size(probe, only=comera.GatedLayer)
    uniform = {t: uniform_ranks(probe, budgets[t] + other)[0] for t in args.targets}
    lowrank = {t: _lowrank_rank(task, budgets[t]) for t in args.targets}
    result["plan"] = {"dense_linear": dense_linear, "uniform_rank": uniform, "lowrank": lowrank}

    def save():
        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write(args.out / "frontier.json", json.dumps(result, indent=1, default=str))

    def add(seed, method, target, start, model, **extra):
        result["rows"].append({"seed": seed, "model": method, "target": target,
                               "seconds": round(time.time() - start, 1),
                               **_score(task, model), **extra})
        save()

    for seed in args.seeds:
        stream = IndexStream(task.train_size(), args.batch, seed)
        if "dense" in args.methods:
            torch.manual_seed(seed)
            dense = task.build_model(tt=False)
            opt = torch.optim.AdamW([{"params": list(dense.parameters()), "lr": args.lr,
                                      "name": "other"}], weight_decay=0.0)
            start = time.time()
            _train(task, dense, comera.DenseTrainer(dense, opt, 1.0), stream, 0, args.steps,
                   args.warmup, lr)
            add(seed, "dense", None, start, dense)
        if "comera" in args.methods:
            torch.manual_seed(seed)
            model = task.build_model(tt=True)
            trainer = comera.CoMERATrainer(model, _tt_optimizer(model, args), 0.0,
                                           max_grad_norm=1.0)
            start = time.time()
            _train(task, model, trainer, stream, 0, args.decide, args.warmup, lr)
            warm = time.time() - start
            for target in args.targets:
                start = time.time()
                late_model, late_opt = copy.deepcopy((model, trainer.optimizer))
                late = comera.CoMERATrainer(late_model, late_opt, 0.0, max_grad_norm=1.0)
                stage = comera.LateStage(budgets[target] + other,
                                         steps=args.steps - args.decide, floor=args.floor,
                                         allocation="spectrum")
                allocation = stage.allocate_(late_model, late_opt)  # start_late_stage's call
                if args.restart:  # the chosen shape, from a fresh init, for all the steps
                    late_model = _shaped_model(task, seed, allocation.ranks)
                    _train(task, late_model, comera.CoMERATrainer(
                        late_model, _tt_optimizer(late_model, args), 0.0, max_grad_norm=1.0),
                        stream, 0, args.steps, args.warmup, lr)
                else:
                    late.start_late_stage(stage)
                    _train(task, late_model, late, stream, args.decide,
                           args.steps - args.decide, args.warmup, lr)
                add(seed, "comera" if args.restart else "comera-warm", target, start - warm,
                    late_model, uniform_rank=uniform[target], restart=args.restart)
        for target in args.targets if "fixed" in args.methods else []:
            rank = uniform[target]
            done = [r for r in result["rows"] if r["seed"] == seed and r["model"] == "fixed"
                    and r.get("rank") == rank]
            if done:  # one run per rank and seed serves every target it fits
                result["rows"].append(done[0] | {"target": target})
                save()
                continue
            torch.manual_seed(seed)
            fixed = PairClassifier(replace(task.model_config(True), rank=rank))
            start = time.time()
            _train(task, fixed, comera.CoMERATrainer(fixed, _tt_optimizer(fixed, args), 0.0,
                                                     max_grad_norm=1.0),
                   stream, 0, args.steps, args.warmup, lr)
            add(seed, "fixed", target, start, fixed, rank=rank)
        for target in args.targets if "lowrank" in args.methods else []:
            rank = lowrank[target]
            if rank < 1:
                continue
            done = [r for r in result["rows"] if r["seed"] == seed and r["model"] == "lowrank"
                    and r.get("rank") == rank]
            if done:
                result["rows"].append(done[0] | {"target": target})
                save()
                continue
            torch.manual_seed(seed)
            low = _lowrank_model(task, rank)
            opt = torch.optim.AdamW([{"params": list(low.parameters()), "lr": args.lr,
                                      "name": "other"}], weight_decay=0.0)
            start = time.time()
            _train(task, low, comera.DenseTrainer(low, opt, 1.0), stream, 0, args.steps,
                   args.warmup, lr)
            add(seed, "lowrank", target, start, low, rank=rank)
        for target in args.targets if "early" in args.methods else []:
            torch.manual_seed(seed)
            model = task.build_model(tt=True)
            stage = EarlyStage(budgets[target] + other, steps=args.steps,
                               landing=args.early_landing)
            trainer = comera.CoMERATrainer(model, _tt_optimizer(model, args), args.lam,
                                           max_grad_norm=1.0, early=stage)
            start = time.time()
            _train(task, model, trainer, stream, 0, args.steps, args.warmup, lr)
            add(seed, "early", target, start, model, lam_scale=trainer.controller.early_scale)
        if "prune" in args.methods:
            torch.manual_seed(seed)
            model = task.build_model(tt=True)
            trainer = comera.CoMERATrainer(model, _tt_optimizer(model, args), args.lam,
                                           max_grad_norm=1.0)
            start = time.time()
            _train(task, model, trainer, stream, 0, args.early, args.warmup, lr)
            round_(model, trainer.optimizer)
            add(seed, "comera early", None, start, model)
            for target in args.targets:
                start = time.time()
                late_model = copy.deepcopy(model)
                late = comera.CoMERATrainer(late_model, _tt_optimizer(late_model, args), 0.0,
                                            max_grad_norm=1.0)
                late.start_late_stage(comera.LateStage(budgets[target] + other,
                                                       steps=args.steps - args.early,
                                                       allocation="prune"))
                _train(task, late_model, late, stream, args.early, args.steps - args.early, 1,
                       lr)
                add(seed, "prune", target, start, late_model)
    return result


def merge(paths: list[Path]) -> dict:
    """One result from several results files: the first's data and machine, every file's rows
    (dense rows of the earlier frontier format, sizes under ``sizes``, are read as well) and
    every file's settings and plan, by path."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    rows = []
    for part in parts:
        for row in part["rows"]:
            if row["model"] == "comera" and not row.get("restart", False):
                row = row | {"model": "comera-warm"}  # written before the rows were named
            if row["model"] not in ROWS:
                continue  # rows of other experiments in an earlier file
            if "linear_compression" not in row and "sizes" in row:
                row = row | {"linear_compression": row["sizes"].get("linear_compression", 1.0)}
            rows.append(row)
    return {"task": parts[0]["task"], "data": parts[0]["data"],
            "machine": next((p["machine"] for p in parts if "machine" in p), machine()),
            "parts": {str(path): {"settings": part.get("settings"), "plan": part.get("plan")}
                      for path, part in zip(paths, parts, strict=True)},
            "rows": rows}


def _no_lowrank(result: dict, target: float) -> bool:
    """Whether a results file's plan says no uniform low-rank model fits ``target``."""
    plans = [result.get("plan")] + [p.get("plan") for p in result.get("parts", {}).values()]
    return any((plan or {}).get("lowrank", {}).get(str(target), (plan or {}).get(
        "lowrank", {}).get(target, -1)) == 0 for plan in plans)


def summarise(result: dict) -> str:
    data = result["data"]
    rows = result["rows"]
    targets = sorted({r["target"] for r in rows if r["target"] is not None})
    methods = [m for m in ROWS if any(r["model"] == m for r in rows)]
    lines = [f"Reviews task: train {data['train']}, val {data['val']}, test {data['test']}; "
             f"majority class: test {data['majority_test']:.4f}. Test accuracy, mean ± sd over "
             "seeds (n); compression of the linear layers in brackets.", ""]
    dense = [r["test"]["accuracy"] for r in rows if r["model"] == "dense"]
    if dense:
        lines += [f"Dense: {mean_sd(dense)} (n={len(dense)}).", ""]
    shown = [m for m in methods if m != "dense"]
    lines += ["| target | " + " | ".join(LABELS[m] for m in shown) + " |",
              "|---" * (len(shown) + 1) + "|"]
    for t in targets:
        cells = []
        for m in shown:
            sel = [r for r in rows if r["model"] == m and r["target"] == t]
            if not sel:
                cells.append("none fits: rank 1 is over the budget"
                             if m == "lowrank" and _no_lowrank(result, t) else "-")
                continue
            acc = [r["test"]["accuracy"] for r in sel]
            comp = statistics.fmean(r["linear_compression"] for r in sel)
            extra = f", rank {sel[0]['rank']}" if m in ("fixed", "lowrank") else ""
            cells.append(f"{mean_sd(acc)} (n={len(acc)}; {comp:.1f}x{extra})")
        lines.append(f"| {t:g}x | " + " | ".join(cells) + " |")
    paired = []
    for t in targets:
        fixed = {r["seed"]: r["test"]["accuracy"] for r in rows
                 if r["model"] == "fixed" and r["target"] == t}
        diffs = [r["test"]["accuracy"] - fixed[r["seed"]] for r in rows
                 if r["model"] == "comera" and r["target"] == t and r["seed"] in fixed]
        if diffs:
            paired.append(f"- {t:g}x: {mean_sd(diffs)} (n={len(diffs)}; seeds "
                          f"{', '.join(f'{d:+.4f}' for d in diffs)})")
    if paired:
        lines += ["", "CoMERA minus the fixed uniform rank, per seed (same batches and seed):", "",
                  *paired]
    seed0 = min((r["seed"] for r in rows), default=0)
    chosen = [r for r in rows if r["model"] == "comera" and r["seed"] == seed0]
    if chosen:
        lines += ["", f"CoMERA's per-layer ranks (seed {seed0}; inner bonds) next to the uniform "
                  "rank at the same target:", ""]
        for r in chosen:
            lines.append(f"- {r['target']:g}x (uniform rank {r.get('uniform_rank')}): " + ", ".join(
                f"{n.replace('blocks.', 'b').replace('attn.', '')} {v[1:-1]}"
                for n, v in r["ranks"].items()))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    rows = result["rows"]
    dense = [r["test"]["accuracy"] for r in rows if r["model"] == "dense"]
    if dense:
        mean = statistics.fmean(dense)
        sd = statistics.stdev(dense) if len(dense) > 1 else 0.0
        ax.axhline(mean, color="k", lw=1, label=f"dense (mean ± sd of {len(dense)})")
        ax.axhspan(mean - sd, mean + sd, color="k", alpha=0.1)
    ax.axhline(result["data"]["majority_test"], color="grey", ls=":", label="majority class")
    for method, marker in (("fixed", "^"), ("lowrank", "v"), ("comera", "o"),
                           ("comera-warm", "s"), ("early", "D"), ("prune", "x")):
        groups: dict = {}
        for r in rows:
            if r["model"] == method and r["target"] is not None:
                groups.setdefault(r["target"], []).append(r)
        if not groups:
            continue
        xs, ys, es = [], [], []
        for t in sorted(groups):
            acc = [r["test"]["accuracy"] for r in groups[t]]
            xs.append(statistics.fmean(r["linear_compression"] for r in groups[t]))
            ys.append(statistics.fmean(acc))
            es.append(statistics.stdev(acc) if len(acc) > 1 else 0.0)
        ax.errorbar(xs, ys, yerr=es, marker=marker, capsize=3, label=LABELS[method])
    ax.set_xscale("log")
    ax.set_xlabel("compression of the linear layers (dense / parameters)")
    ax.set_ylabel("test accuracy (mean ± sd over seeds)")
    ax.set_title("Reviews: four ways to spend a parameter budget")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def training_args(p) -> None:
    """The training settings every reviews model of a comparison shares (and so takes the same
    flags for): batch, sequence length, learning rates, warm-up and threads."""
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-gates", type=float, default=1e-2)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--targets", type=float, nargs="+", default=[10, 30, 50, 100, 130])
    p.add_argument("--methods", nargs="+", choices=METHODS,
                   default=["dense", "fixed", "lowrank", "comera"])
    p.add_argument("--steps", type=int, default=450)
    p.add_argument("--decide", type=int, default=112,
                   help="comera: steps at full rank before the late stage fixes the shape")
    p.add_argument("--floor", choices=comera.ranks.allocate.FLOORS, default="uniform",
                   help="comera: the allocation starts from the uniform ranks or from rank 1")
    p.add_argument("--restart", action="store_true", default=True,
                   help="comera (the default): train the chosen shape from a fresh init for all "
                        "--steps, as the fixed rank is")
    p.add_argument("--warm", dest="restart", action="store_false",
                   help="comera: go on from the decided model for the remaining steps instead "
                        "(rows named comera-warm)")
    p.add_argument("--early", type=int, default=300, help="prune: early-stage steps")
    p.add_argument("--lam", type=float, default=0.05, help="prune, early: early-stage lam")
    p.add_argument("--early-landing", type=float, default=0.5,
                   help="early: the fraction of --steps the size schedule spans")
    training_args(p)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--append", action="store_true",
                   help="keep the rows already in the results file (more seeds or methods)")
    p.add_argument("--summarise-only", action="store_true")
    p.add_argument("--merge", type=Path, nargs="+", default=[],
                   help="write --out from the rows of these results files (runs made in pieces, "
                        "e.g. one method per process) instead of training")
    args = p.parse_args(argv)
    if not 0 < args.decide < args.steps:
        p.error(f"--decide {args.decide}: give a step count in (0, --steps={args.steps})")
    if not 0 < args.early_landing <= 1:
        p.error(f"--early-landing {args.early_landing}: give a fraction in (0, 1]")
    if args.threads < 1:
        p.error(f"--threads {args.threads}: give at least 1")
    torch.set_num_threads(args.threads)
    if args.merge:
        result = merge(args.merge)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "frontier.json").write_text(json.dumps(result, indent=1, default=str))
    elif args.summarise_only:
        result = json.loads((args.out / "frontier.json").read_text())
    else:
        result = run(args)
    (args.out / "frontier.md").write_text(summarise(result) + "\n")
    plot(result, args.out / "frontier.png")
    print(summarise(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
