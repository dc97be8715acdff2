r"""Seeds and a compression/accuracy frontier for the transformer on the reviews task.

    python -m benchmarks.accuracy_frontier --seeds 0 1 2 --targets 10 30 50 100 130 \
        --early-full --full-lam 1.5 --full-regularizer size_weighted

Per seed, on the same split and the same number of steps: a dense model (``early + late``
steps), and a CoMERA model whose early stage (``early`` steps, loss + lam * R) is then copied
once per target and trained ``late`` more steps with the late stage's step budget toward that
compression of its TT layers (with TT rounding, ``LateStage(rounding=True)``; ``--no-rounding``
for the plain pruning). Options add: ``--early-full``, a CoMERA model trained with the early
stage alone for all ``early + late`` steps (lam 0 for ``--full-lam-start`` steps, then ramped
to ``--full-lam``); ``--fixed-ranks R``, the model at TT rank R, trained without pruning (what
the architecture can do at that size). Early models are rounded at the end of their stage
(exact: it only frees slices a rank-1 neighbour makes useless). Test accuracy is scored at the
end of each; the majority-class baseline is written next to it. Results:
``benchmarks/results/reviews_frontier/frontier.json``
(rewritten after every model, so a cut-off run keeps what it finished), ``frontier.md`` and
``frontier.png`` (test accuracy vs compression of the linear layers, one point per seed, the
dense mean and spread as a band).
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

import comera
from benchmarks.lib.harness import RESULTS
from comera.experiments.engine import sizes_of
from comera.experiments.task import IndexStream
from comera.experiments.transformer_task import ReviewsTask, ReviewsTaskConfig
from comera.models import PairClassifier, TransformerConfig
from comera.ranks.truncate import round_

OUT = RESULTS / "reviews_frontier"


class SmallReviews(ReviewsTask):
    """The reviews task on a d_model-128 encoder (2 layers, FFN 512), CPU-minutes per model.
    The token table stays dense, so the TT layers (and the late stage's targets) are exactly the
    linear layers: the compression the targets of issue 13 speak of."""

    def model_config(self, tt: bool) -> TransformerConfig:
        base = super().model_config(tt)
        return replace(base, d_model=128, n_heads=4, d_ff=512, rank=16, tt_embedding=False,
                       attn_modes=None, ffn_in_modes=None, ffn_out_modes=None)


def _lr(step: int, warmup: int) -> float:
    return min(1.0, (step + 1) / warmup)


def _train(task, model, trainer, stream, first: int, steps: int, warmup: int, base: dict,
           lam=None):
    """``steps`` steps from ``first``; ``lam``: the early stage's lam per step (a function)."""
    model.train()
    for step in range(first, first + steps):
        for group in trainer.optimizer.param_groups:
            group["lr"] = base[group.get("name", "other")] * _lr(step, warmup)
        if lam is not None:
            trainer.lam = lam(step)
        trainer.step(task.loss(model, task.batch(stream.indices(step))))


def _lam_schedule(args):
    """The all-steps early stage's lam: 0 for ``full_lam_start`` steps (the model learns before
    anything is pruned), then a linear ramp to ``full_lam`` over ``full_lam_ramp`` steps."""
    def lam(step: int) -> float:
        ramp = (step - args.full_lam_start + 1) / max(args.full_lam_ramp, 1)
        return args.full_lam * min(1.0, max(0.0, ramp))
    return lam


def _score(task, model) -> dict:
    model.eval()
    with torch.no_grad():
        test = task.evaluate(model, "test")
    model.train()
    sizes = sizes_of(model)
    ranks = {n: list(m.ranks) for n, m in comera.tt_modules(model)}
    return {"test": test, "sizes": sizes, "ranks": ranks}


def run(args) -> dict:
    task = SmallReviews(ReviewsTaskConfig(max_len=args.max_len))
    result = {"task": "reviews (title, review) -> recommended", "data": task.describe(),
              "settings": vars(args) | {"out": str(args.out)}, "rows": []}
    if args.append and (args.out / "frontier.json").is_file():
        result["rows"] = json.loads((args.out / "frontier.json").read_text())["rows"]
    lr = {"cores": args.lr, "gates": args.lr_gates, "other": args.lr}

    def save():
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "frontier.json").write_text(json.dumps(result, indent=1, default=str))

    for seed in args.seeds:
        stream = IndexStream(task.train_size(), args.batch, seed)
        torch.manual_seed(seed)
        dense = task.build_model(tt=False)
        opt = torch.optim.AdamW([{"params": list(dense.parameters()), "lr": args.lr,
                                  "name": "other"}], weight_decay=0.0)
        start = time.time()
        _train(task, dense, comera.DenseTrainer(dense, opt, 1.0), stream, 0,
               args.early + args.late, args.warmup, lr)
        result["rows"].append({"seed": seed, "model": "dense", "target": None,
                               "seconds": time.time() - start, **_score(task, dense)})
        save()
        for rank in args.fixed_ranks:
            torch.manual_seed(seed)
            # the same model at one fixed TT rank, trained without pruning: what the
            # architecture can do at that size, the reference for the pruned models
            fixed = PairClassifier(replace(task.model_config(True), rank=rank))
            start = time.time()
            _train(task, fixed, comera.CoMERATrainer(fixed, comera.make_optimizer(
                fixed, comera.OptimizerConfig(args.lr, args.lr_gates, args.lr)), 0.0,
                max_grad_norm=1.0), stream, 0, args.early + args.late, args.warmup, lr)
            result["rows"].append({"seed": seed, "model": f"TT rank {rank}, no pruning",
                                   "target": None, "seconds": time.time() - start,
                                   **_score(task, fixed)})
            save()
        torch.manual_seed(seed)
        model = task.build_model(tt=True)
        trainer = comera.CoMERATrainer(model, comera.make_optimizer(
            model, comera.OptimizerConfig(args.lr, args.lr_gates, args.lr)), args.lam,
            max_grad_norm=1.0)
        start = time.time()
        _train(task, model, trainer, stream, 0, args.early, args.warmup, lr)
        if not args.no_rounding:  # exact: frees the slices a rank-1 neighbour makes useless
            round_(model, trainer.optimizer)
        result["rows"].append({"seed": seed, "model": "comera early", "target": None,
                               "seconds": time.time() - start, **_score(task, model)})
        save()
        if args.early_full:  # the early stage alone, on the dense model's whole step budget
            torch.manual_seed(seed)
            full = task.build_model(tt=True)
            full_trainer = comera.CoMERATrainer(full, comera.make_optimizer(
                full, comera.OptimizerConfig(args.lr, args.lr_gates, args.lr)), args.full_lam,
                max_grad_norm=1.0, regularizer=args.full_regularizer)
            start = time.time()
            _train(task, full, full_trainer, stream, 0, args.early + args.late, args.warmup, lr,
                   _lam_schedule(args))
            if not args.no_rounding:
                round_(full, full_trainer.optimizer)
            result["rows"].append({"seed": seed, "model": "comera early (all steps)",
                                   "target": None, "seconds": time.time() - start,
                                   **_score(task, full)})
            save()
        for target in args.targets:
            late_model = copy.deepcopy(model)
            late_trainer = comera.CoMERATrainer(late_model, comera.make_optimizer(
                late_model, comera.OptimizerConfig(args.lr, args.lr_gates, args.lr)), 0.0,
                max_grad_norm=1.0, min_rank=args.min_rank)
            non_tt = comera.model_size(late_model) - comera.model_size(
                late_model, only=comera.GatedTrain)
            dense_tt = comera.dense_size(late_model, only=comera.GatedTrain)
            late_trainer.start_late_stage(comera.LateStage(
                dense_tt / target + non_tt, steps=args.late, rounding=not args.no_rounding))
            start = time.time()
            _train(task, late_model, late_trainer, stream, args.early, args.late, 1, lr)
            result["rows"].append({"seed": seed, "model": "comera late", "target": target,
                                   "seconds": time.time() - start,
                                   **_score(task, late_model)})
            save()
    return result


def summarise(result: dict) -> str:
    data = result["data"]
    lines = [f"Reviews task: train {data['train']}, val {data['val']}, test {data['test']}; "
             f"majority-class baseline: val {data['majority_val']:.4f}, test "
             f"{data['majority_test']:.4f}.", "",
             "| model | target | seeds | test accuracy (mean ± sd) | linear compression | "
             "TT compression (all TT layers) |", "|---|---|---|---|---|---|"]
    groups: dict = {}
    for row in result["rows"]:
        groups.setdefault((row["model"], row["target"]), []).append(row)
    for (name, target), rows in groups.items():
        acc = [r["test"]["accuracy"] for r in rows]
        sd = statistics.stdev(acc) if len(acc) > 1 else float("nan")
        lin = [r["sizes"].get("linear_compression", 1.0) for r in rows]
        tt = [r["sizes"].get("tt_compression", 1.0) for r in rows]
        lines.append(f"| {name} | {f'{target:g}x' if target else '-'} | {len(rows)} | "
                     f"{statistics.fmean(acc):.4f} ± {sd:.4f} | {statistics.fmean(lin):.1f}x | "
                     f"{statistics.fmean(tt):.1f}x |")
    lines += ["", "Per-layer ranks at each target (seed of the first row):", ""]
    for row in result["rows"]:
        if row["model"] == "comera late" and row["seed"] == result["rows"][0]["seed"]:
            lines.append(f"- {row['target']:g}x: " + ", ".join(
                f"{n}: {r[1:-1]}" for n, r in row["ranks"].items()))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    dense = [r["test"]["accuracy"] for r in result["rows"] if r["model"] == "dense"]
    if dense:
        mean = statistics.fmean(dense)
        sd = statistics.stdev(dense) if len(dense) > 1 else 0.0
        ax.axhline(mean, color="k", lw=1, label=f"dense (mean of {len(dense)})")
        ax.axhspan(mean - sd, mean + sd, color="k", alpha=0.1)
    ax.axhline(result["data"]["majority_test"], color="grey", ls=":", label="majority class")
    names = [("comera early", "s"), ("comera early (all steps)", "D"), ("comera late", "o")] + [
        (n, "^") for n in dict.fromkeys(r["model"] for r in result["rows"]) if "no pruning" in n]
    for name, marker in names:
        rows = [r for r in result["rows"] if r["model"] == name]
        if rows:
            ax.scatter([r["sizes"]["linear_compression"] for r in rows],
                       [r["test"]["accuracy"] for r in rows], marker=marker, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("compression of the linear layers (dense / TT parameters)")
    ax.set_ylabel("test accuracy")
    ax.set_title("Reviews: accuracy vs compression (one point per seed and target)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--targets", type=float, nargs="+", default=[10, 30, 100, 300])
    p.add_argument("--early", type=int, default=300)
    p.add_argument("--late", type=int, default=150)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-gates", type=float, default=1e-2)
    p.add_argument("--lam", type=float, default=0.05)
    p.add_argument("--min-rank", type=int, default=1,
                   help="late stage: no bond is pruned below this rank (CoMERATrainer min_rank)")
    p.add_argument("--early-full", action="store_true",
                   help="also train a CoMERA model with the early stage alone for early + late "
                        "steps (the dense model's budget), with the --full-* settings")
    p.add_argument("--full-lam", type=float, default=1.0)
    p.add_argument("--full-lam-start", type=int, default=150,
                   help="all-steps early stage: lam is 0 for this many steps (it learns first)")
    p.add_argument("--full-lam-ramp", type=int, default=100,
                   help="all-steps early stage: then lam ramps up linearly over this many steps")
    p.add_argument("--full-regularizer", choices=comera.ranks.objective.REGULARIZERS, default="l1")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-rounding", action="store_true",
                   help="late stage without TT rounding (LateStage(rounding=False)): as before")
    p.add_argument("--fixed-ranks", type=int, nargs="*", default=[],
                   help="also train the model at these fixed TT ranks, without pruning")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--append", action="store_true",
                   help="keep the rows already in the results file (more seeds)")
    p.add_argument("--summarise-only", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.summarise_only:
        result = json.loads((args.out / "frontier.json").read_text())
    else:
        result = run(args)
    (args.out / "frontier.md").write_text(summarise(result) + "\n")
    plot(result, args.out / "frontier.png")
    print(summarise(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

