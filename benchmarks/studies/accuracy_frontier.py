r"""The compression/accuracy frontier on the reviews task: dense, a fixed uniform TT rank, the
low-rank format and CoMERA, at matched sizes, on the same data, steps and seeds.

    python -m benchmarks.studies.accuracy_frontier --seeds 0 1 2 --targets 10 30 50 100 130

Per seed, every model trains ``--steps`` steps on the engine (:mod:`benchmarks.studies.harness`:
the same batches, the same AdamW learning rates, ``--lr`` for weights and ``--lr-gates`` for the
gates, the same schedule, linear warm-up over ``--warmup`` steps, then constant):

- ``dense``: the model with dense linear layers.
- ``fixed``: per target, the largest uniform TT rank whose linear layers fit the target size
  (:func:`comera.ranks.budget.uniform_rank`), trained at that shape without pruning (each rank
  is trained once per seed and reported at every target it serves).
- ``fixed-balanced``: the fixed uniform TT rank with its layers built in the balanced
  parametrization (``comera.formats.scaling``) instead of the task's plain cores (issue 30).
- ``lowrank``: per target, every linear layer in the ``lowrank`` format (``x @ A @ B``) at the
  largest uniform rank fitting the same size, trained as the fixed rank is (rows made before the
  format, with the ungated ``LowRankLinear``, carry no ``format``); targets where rank 1 does
  not fit have no row.
- ``comera``: rank 16 trained for ``--decide`` steps, then per target the spectrum allocation
  (:mod:`comera.ranks.allocate`: the budget spent on the slices of most energy per parameter,
  from the uniform allocation up), which fixes the shape; that shape trains from a fresh
  initialisation for all ``--steps`` (the harness's ``spectrum`` method).
- ``early`` (optional): the early stage alone with a size target (the engine's
  ``early_target``, landing ``--early-landing``): rank 16, lam ``--lam`` adapted toward the size
  schedule, off at the target; all ``--steps`` steps.
- ``prune`` (optional): an early stage of ``--early`` steps (lam ``--lam``) then the late stage
  pruning to each target over the remaining steps (the harness's ``comera`` method).

Test accuracy (and validation accuracy) is scored at the end of each. Sizes count the linear
layers (biases included), the size the targets speak of. Results go to ``--out``
(``frontier.json``, rewritten after every model so a cut-off run keeps what it finished;
``frontier.md``: mean ± sd per method and target, and CoMERA's per-layer ranks next to the
uniform ones; ``frontier.png``). Rows of the ``--warm`` variant of before (``comera-warm``)
are still read and reported.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

import comera
from benchmarks.lib.measure import RESULTS
from benchmarks.studies.harness.methods import Study
from benchmarks.studies.harness.results import mean_sd, read_summary, write_summary
from benchmarks.studies.harness.reviews import SmallReviews, training_args
from comera.experiments.engine import EngineConfig
from comera.experiments.results import machine
from comera.experiments.transformer_task import ReviewsTaskConfig
from comera.ranks.budget import uniform_rank
from tncomp.files import atomic_write_text

OUT = RESULTS / "reviews_frontier"
METHODS = ("dense", "fixed", "fixed-balanced", "lowrank", "comera", "early", "prune")
ROWS = ("dense", "fixed", "fixed-balanced", "lowrank", "lowrank-ungated", "comera",
        "comera-warm", "early",
        "prune")  # the names rows carry
LABELS = {"dense": "dense", "fixed": "fixed uniform TT rank",
          "fixed-balanced": "fixed uniform TT rank, balanced cores",
          "lowrank": "low-rank x @ A @ B",
          "lowrank-ungated": "low-rank x @ A @ B (ungated LowRankLinear, before the format)",
          "comera": "CoMERA", "comera-warm": "CoMERA, warm (no restart)",
          "early": "CoMERA early stage to the target", "prune": "CoMERA (prune)"}


def _as_row(row: dict, model: str, **extra) -> dict:
    """A harness row in this study's results format (``model``, ``linear_compression``)."""
    row = {k: v for k, v in row.items() if k not in ("method", "lr")}
    return {**row, "model": model, "linear_compression": row["compression"], **extra}


def run(args) -> dict:
    task = SmallReviews(ReviewsTaskConfig(max_len=args.max_len))
    result = {"task": "reviews (title, review) -> recommended", "data": task.describe(),
              "settings": vars(args) | {"out": str(args.out), "work": str(args.work)},
              "machine": machine(), "rows": []}
    if args.append and (args.out / "frontier.json").is_file():
        result["rows"] = [upgrade(r) for r in read_summary(args.out / "frontier.json")["rows"]]
    config = EngineConfig(batch_size=args.batch, lr=args.lr, lr_gates=args.lr_gates,
                          warmup=args.warmup, eval_every=args.eval_every, max_grad_norm=1.0,
                          threads=args.threads, late_allocation="prune")  # as measured
    study = Study(task, config, args.work, steps=args.steps, early=args.early,
                  decide=args.decide, lam=args.lam, max_rank=16, floor=args.floor,
                  early_landing=args.early_landing)
    budgets = {t: study.budget(t) for t in args.targets}
    uniform = {t: uniform_rank("tt", study.shapes(), budgets[t]) for t in args.targets}
    lowrank = {t: uniform_rank("lowrank", study.shapes(), budgets[t]) for t in args.targets}
    result["plan"] = {"dense_linear": round(budgets[args.targets[0]] * args.targets[0]),
                      "uniform_rank": uniform, "lowrank": lowrank}

    def save(*rows):
        result["rows"].extend(rows)
        args.out.mkdir(parents=True, exist_ok=True)
        write_summary(args.out / "frontier.json", result)

    lr = args.lr
    for seed in args.seeds:
        if "dense" in args.methods:
            save(_as_row(study.dense(seed, lr), "dense"))
        if "comera" in args.methods:
            for r in study.spectrum(args.targets, seed, lr):
                save(_as_row(r, "comera", uniform_rank=uniform[r["target"]], restart=True))
        for fmt, name, ranks in (("tt", "fixed", uniform), ("tt", "fixed-balanced", uniform),
                                 ("lowrank", "lowrank", lowrank)):
            for target in args.targets if name in args.methods else []:
                if ranks[target] < 1:
                    continue
                done = [r for r in result["rows"] if r["seed"] == seed and r["model"] == name
                        and r.get("rank") == ranks[target]]
                if done:  # one run per rank and seed serves every target it fits
                    save(done[0] | {"target": target})
                    continue
                balanced = ({"method": name, "parametrization": "balanced"}
                            if name == "fixed-balanced" else {})
                save(_as_row(study.fixed(fmt, target, seed, lr, **balanced), name))
        for target in args.targets if "early" in args.methods else []:
            save(_as_row(study.early_stage(target, seed, lr), "early"))
        if "prune" in args.methods:
            rows = study.comera(args.targets, seed, lr, method="prune")
            save(_as_row(rows[0], "comera early"), *(_as_row(r, "prune") for r in rows[1:]))
    return result


def upgrade(row: dict) -> dict:
    """A row as today's names have it: CoMERA rows of the warm variant (written before the rows
    were named) are ``comera-warm``; low-rank rows of the ungated ``LowRankLinear`` (before the
    lowrank format: no ``format``) are ``lowrank-ungated``."""
    if row["model"] == "comera" and not row.get("restart", False):
        return row | {"model": "comera-warm"}
    if row["model"] == "lowrank" and "format" not in row:
        return row | {"model": "lowrank-ungated"}
    return row


def merge(paths: list[Path]) -> dict:
    """One result from several results files: the first's data and machine, every file's rows
    (dense rows of the earlier frontier format, sizes under ``sizes``, are read as well) and
    every file's settings and plan, by path."""
    parts = [read_summary(p) for p in paths]
    rows = []
    for part in parts:
        for row in part["rows"]:
            row = upgrade(row)
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
                             if m.startswith("lowrank") and _no_lowrank(result, t) else "-")
                continue
            acc = [r["test"]["accuracy"] for r in sel]
            comp = statistics.fmean(r["linear_compression"] for r in sel)
            extra = f", rank {sel[0]['rank']}" if m.startswith(("fixed", "lowrank")) else ""
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
    for method, marker in (("fixed", "^"), ("fixed-balanced", ">"), ("lowrank", "v"),
                           ("lowrank-ungated", "<"),
                           ("comera", "o"),
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
    p.add_argument("--early", type=int, default=300, help="prune: early-stage steps")
    p.add_argument("--lam", type=float, default=0.05, help="prune, early: early-stage lam")
    p.add_argument("--early-landing", type=float, default=0.5,
                   help="early: the fraction of --steps the size schedule spans")
    training_args(p)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--work", type=Path, default=Path("/tmp/reviews_frontier_work"),
                   help="the engine's run folder (a checkpoint per model)")
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
    if not 0 < args.early < args.steps:
        p.error(f"--early {args.early}: give a step count in (0, --steps={args.steps})")
    if args.threads < 1 or args.eval_every < 1:
        p.error(f"--threads {args.threads} --eval-every {args.eval_every}: both at least 1")
    torch.set_num_threads(args.threads)
    if args.merge:
        result = merge(args.merge)
        write_summary(args.out / "frontier.json", result)
    elif args.summarise_only:
        if not (args.out / "frontier.json").is_file():
            p.error(f"--summarise-only: no {args.out / 'frontier.json'} to summarise")
        result = read_summary(args.out / "frontier.json")
        result["rows"] = [upgrade(r) for r in result["rows"]]
    else:
        result = run(args)
    atomic_write_text(args.out / "frontier.md", summarise(result) + "\n")
    plot(result, args.out / "frontier.png")
    print(summarise(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
