r"""Test accuracy on the reviews task per weight format, every format at about the same size.

    python -m benchmarks.studies.formats_accuracy --seeds 0 1 2 --target 50 --threads 1

For each layer format (:func:`comera.formats.registry.layer_formats`; ``einsum`` is only
declared by an equation, so it has no layer of its own) the SmallReviews classifier
(:mod:`benchmarks.studies.harness.reviews`; d_model 128, 2 layers) is built with every encoder
linear layer as a ``GatedLinear(format=f, ranks=r)``, at the largest uniform int rank r whose
linear layers (biases included) have at most ``dense / --target`` parameters, counted from the
layouts, before any training. A format whose rank 1 is already larger gets a row saying so (its
rank-1 compression) and is not trained.

Every model trains on the engine as the harness's format method does (the reviews frontier's
"fixed" model for ``tt``): seeded right before it is built (the layers made in the same order,
by the model's own ``TransformerConfig(linear_format=...)``), the same batches, AdamW at
``--lr`` (gates ``--lr-gates``) with ``--warmup`` warm-up steps, grad-norm clip 1.0, no rank
adaptation (lam 0, no late stage), ``--steps`` steps. The dense model trains the same way in the
same process, per seed.

Runs are seed-major (every format for seed 0, then seed 1, ...); ``--out``/formats.json and
formats.md are rewritten after every model, so a cut-off run still gives its n=1 or n=2 rows.
``--append`` keeps the rows already there (a run resumed: (seed, format) pairs done are
skipped).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks.lib.measure import RESULTS, markdown_table
from benchmarks.studies.harness.methods import Study
from benchmarks.studies.harness.results import read_summary, write_summary
from benchmarks.studies.harness.reviews import SmallReviews, training_args
from comera.data.stdlib_pairs import PairDataset
from comera.errors import ConfigError
from comera.experiments.engine import EngineConfig
from comera.experiments.results import machine
from comera.experiments.transformer_task import ReviewsTaskConfig
from comera.formats.registry import DENSE, layer_formats
from comera.ranks.budget import dense_linear_size, linear_size, uniform_rank
from tncomp.files import atomic_write_text

OUT = RESULTS / "formats_reviews"
SKIP = {"einsum": "declared by an equation only (GatedLinear.from_eq): no layer of its own"}
MAX_RANK = 512  # no format here gains parameters past this rank on 128- and 512-wide layers
D = 3  # modes per side, as the fixed TT model factorises its layers


def trained_formats() -> tuple[str, ...]:
    """The registered formats this benchmark trains: every layer format (a declared one has no
    layer of its own)."""
    return tuple(f for f in layer_formats() if f != DENSE)


def rank_for(fmt: str, shapes, budget: float) -> tuple[int, int]:
    """(rank, parameters): the largest uniform rank whose layers fit ``budget``
    (:func:`comera.ranks.budget.uniform_rank`), or (0, rank-1 parameters) when not even rank 1
    fits."""
    rank = uniform_rank(fmt, shapes, budget, D, MAX_RANK)
    return rank, linear_size(fmt, shapes, max(rank, 1), D)


def plan(study: Study, formats, target: float) -> dict:
    """Per format: the rank, its linear parameters and compression at ``dense / target``."""
    shapes = study.shapes()
    dense = dense_linear_size(shapes)
    budget = dense / target
    out = {"dense_linear": dense, "budget": budget, "formats": {}}
    for fmt in formats:
        rank, params = rank_for(fmt, shapes, budget)
        out["formats"][fmt] = {"rank": rank, "linear_params": params,
                               "compression": dense / params, "fits": rank > 0}
    return out


def study_of(task, args) -> Study:
    """The study: every model ``--steps`` steps at the shared training flags."""
    config = EngineConfig(batch_size=args.batch, lr=args.lr, lr_gates=args.lr_gates,
                          warmup=args.warmup, eval_every=args.eval_every, max_grad_norm=1.0,
                          threads=args.threads, late_allocation="prune")  # as measured
    return Study(task, config, args.work, steps=args.steps)


def _smoke_task(task, n: int = 64):
    """Evaluation on the first ``n`` examples of val and test (smoke runs only)."""
    for split in ("val", "test"):
        data = getattr(task, split)
        setattr(task, split, PairDataset(data.ids[:n], data.segments[:n], data.labels[:n]))
    return task


def run(args) -> dict:
    task = SmallReviews(ReviewsTaskConfig(max_len=args.max_len))
    if args.smoke:
        _smoke_task(task)
    study = study_of(task, args)
    the_plan = plan(study, args.formats, args.target)
    path = args.out / "formats.json"
    result = {"task": "reviews (title, review) -> recommended, SmallReviews (d_model 128, "
                      "2 layers)", "data": task.describe(),
              "settings": vars(args) | {"out": str(args.out), "work": str(args.work)},
              "machine": machine(), "plan": the_plan, "rows": []}
    if args.append and path.is_file():
        result["rows"] = read_summary(path)["rows"]

    def save() -> None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_summary(path, result)
        atomic_write_text(args.out / "formats.md", summarise(result) + "\n")

    save()
    for seed in args.seeds:
        for name in [*args.formats, "dense"]:
            if any(r["seed"] == seed and r["model"] == name for r in result["rows"]):
                continue
            if name != "dense" and not the_plan["formats"][name]["fits"]:
                continue
            row = (study.dense(seed, args.lr) if name == "dense"
                   else study.fixed(name, args.target, seed, args.lr))
            row = {k: v for k, v in row.items() if k not in ("method", "target", "lr")}
            result["rows"].append({"seed": seed, "model": name, "rank": row.pop("rank", None),
                                   "linear_compression": row["compression"], **row})
            save()
            print(f"seed {seed} {name}: test {row['test']['accuracy']:.4f} "
                  f"({row['compression']:.1f}x, {row['seconds']} s)", flush=True)
    return result


def _stats(values: list[float]) -> str:
    if not values:
        return "-"
    sd = f"{statistics.stdev(values):.4f}" if len(values) > 1 else "n/a"
    return f"{statistics.fmean(values):.4f} ± {sd} (n={len(values)})"


def summarise(result: dict) -> str:
    """The table: one row per format (untrained ones say why), dense and the majority class."""
    data, rows, the_plan = result["data"], result["rows"], result["plan"]
    m = result["machine"]
    settings = result["settings"]
    lines = [f"Reviews task (SmallReviews: d_model 128, 2 layers): train {data['train']}, val "
             f"{data['val']}, test {data['test']}. Every encoder linear layer in the format at "
             f"the largest uniform rank fitting dense / {settings['target']:g} = "
             f"{the_plan['budget']:.0f} parameters (of {the_plan['dense_linear']}, biases "
             f"included); {settings['steps']} steps, batch {settings['batch']}, AdamW lr "
             f"{settings['lr']:g} (gates {settings['lr_gates']:g}), {settings['warmup']} warm-up "
             "steps, clip 1.0, no rank adaptation; seeds "
             f"{', '.join(str(s) for s in settings['seeds'])}. Accuracy mean ± sd over seeds (n); "
             f"seconds: mean per model. torch {m['torch']}, {m['cpu']}, {m['threads']} thread(s).",
             ""]
    table = []
    for name in [*the_plan["formats"], "dense"]:
        sel = [r for r in rows if r["model"] == name]
        test = [r["test"]["accuracy"] for r in sel]
        val = [r["val"]["accuracy"] for r in sel]
        secs = f"{statistics.fmean(r['seconds'] for r in sel):.0f}" if sel else "-"
        if name == "dense":
            table.append(["dense", "-", the_plan["dense_linear"], "1.0x", _stats(test),
                          _stats(val), secs])
            continue
        p = the_plan["formats"][name]
        if not p["fits"]:
            table.append([name, "-", p["linear_params"], f"{p['compression']:.1f}x",
                          f"not trained: rank 1 is {p['compression']:.1f}x, short of "
                          f"{settings['target']:g}x", "-", "-"])
            continue
        table.append([name, p["rank"], p["linear_params"], f"{p['compression']:.1f}x",
                      _stats(test) if sel else "not run", _stats(val) if sel else "-", secs])
    table.append(["majority class", "-", "-", "-", f"{data['majority_test']:.4f}",
                  f"{data['majority_val']:.4f}", "-"])
    lines.append(markdown_table(["format", "rank", "linear params", "compression",
                                 "test accuracy", "val accuracy", "seconds"], table))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--target", type=float, default=50.0,
                   help="compression of the linear layers: dense / parameters at most")
    p.add_argument("--formats", nargs="+", default=None,
                   help=f"formats to run (default: all registered but {', '.join(SKIP)})")
    p.add_argument("--steps", type=int, default=450)
    training_args(p)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--work", type=Path, default=Path("/tmp/formats_reviews_work"),
                   help="the engine's run folder (a checkpoint per model)")
    p.add_argument("--append", action="store_true",
                   help="keep the rows already in --out/formats.json; skip (seed, model) done")
    p.add_argument("--smoke", action="store_true",
                   help="a check of the pipeline: 2 steps, 64 val/test examples")
    p.add_argument("--summarise-only", action="store_true")
    args = p.parse_args(argv)
    known = trained_formats()
    args.formats = args.formats or list(known)
    bad = [f for f in args.formats if f not in known]
    if bad:
        p.error(f"--formats {' '.join(bad)}: choose from {', '.join(known)}")
    if args.target <= 1:
        p.error(f"--target {args.target:g}: give a compression > 1 (e.g. 50)")
    if args.steps < 1 or args.warmup < 1 or args.eval_every < 1 or args.threads < 1:
        p.error(f"--steps {args.steps} --warmup {args.warmup} --eval-every {args.eval_every} "
                f"--threads {args.threads}: each must be >= 1")
    if args.smoke:
        args.steps, args.warmup = 2, 1
    if args.summarise_only:
        result = read_summary(args.out / "formats.json")
    else:
        try:
            result = run(args)
        except ConfigError as err:
            p.error(str(err))
    print(summarise(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
