r"""Test accuracy on the reviews task per weight format, every format at about the same size.

    python -m benchmarks.studies.formats_accuracy --seeds 0 1 2 --target 50 --threads 1

For each registered format (:func:`comera.formats.registry.format_names`; ``einsum`` is only
declared by an equation, so it has no layer of its own here) the SmallReviews classifier of
:mod:`benchmarks.studies.accuracy_frontier` (d_model 128, 2 layers) is built with every encoder
linear layer (the layers that frontier's "fixed" method makes TT) as a ``GatedLinear(format=f,
ranks=r)``, at the largest uniform int rank r whose linear layers (biases included) have at
most ``dense / --target`` parameters, counted from the layouts, before any training. A format
whose rank 1 is already larger gets a row saying so (its rank-1 compression) and is not
trained.

Every model is then built and trained exactly as that frontier's "fixed" model is:
``torch.manual_seed(seed)`` right before the model is constructed (the layers are made in the
same order, by the model's own ``TransformerConfig(linear_format=...)``, so format ``tt``
gives the fixed model itself), the same batches (:class:`IndexStream` of the seed), AdamW at
``--lr`` (gates ``--lr-gates``) with ``--warmup`` warm-up steps, grad-norm clip 1.0, no rank
adaptation (lam 0, no late stage), ``--steps`` steps. The dense model (``tt=False``) trains the
same way in the same process, per seed, as the frontier's dense rows do.

Runs are seed-major (every format for seed 0, then seed 1, ...); ``--out``/formats.json and
formats.md are rewritten after every model, so a cut-off run still gives its n=1 or n=2 rows.
``--append`` keeps the rows already there (a run resumed: (seed, format) pairs done are
skipped).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

import comera
from benchmarks.lib.harness import RESULTS, markdown_table
from benchmarks.studies.accuracy_frontier import (
    SmallReviews,
    _score,
    _train,
    _tt_optimizer,
    machine,
    training_args,
)
from comera.data.stdlib_pairs import PairDataset
from comera.errors import ConfigError
from comera.experiments.task import IndexStream
from comera.experiments.transformer_task import ReviewsTaskConfig
from comera.formats.registry import format_names
from comera.models import PairClassifier
from comera.ranks.budget import linear_size, uniform_rank

OUT = RESULTS / "formats_reviews"
SKIP = {"einsum": "declared by an equation only (GatedLinear.from_eq): no layer of its own"}
MAX_RANK = 512  # no format here gains parameters past this rank on 128- and 512-wide layers
D = 3  # modes per side, as the fixed TT model factorises its layers


def trained_formats() -> tuple[str, ...]:
    """The registered formats this benchmark trains (all but the declared-only ones)."""
    return tuple(f for f in format_names() if f not in SKIP)


def encoder_shapes(task) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of every encoder linear layer of the dense model."""
    model = task.build_model(tt=False)
    return [(n, m.in_features, m.out_features) for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and n.startswith("blocks.")]


def rank_for(fmt: str, shapes, budget: float) -> tuple[int, int]:
    """(rank, parameters): the largest uniform rank whose layers fit ``budget``
    (:func:`comera.ranks.budget.uniform_rank`), or (0, rank-1 parameters) when not even rank 1
    fits."""
    layers = [(n_in, n_out, True) for _, n_in, n_out in shapes]
    rank = uniform_rank(fmt, layers, budget, D, MAX_RANK)
    return rank, linear_size(fmt, layers, max(rank, 1), D)


def build_model(task, fmt: str, rank: int, seed: int) -> nn.Module:
    """The classifier with every encoder linear layer in ``fmt`` at ``rank``, initialised from
    ``seed`` as the fixed-rank TT model is (``fmt="tt"``: that model itself)."""
    cfg = replace(task.model_config(True), rank=rank, linear_format=fmt)
    torch.manual_seed(seed)
    return PairClassifier(cfg)


def plan(task, formats, target: float) -> dict:
    """Per format: the rank, its linear parameters and compression at ``dense / target``."""
    shapes = encoder_shapes(task)
    dense = sum(n_in * n_out + n_out for _, n_in, n_out in shapes)
    budget = dense / target
    out = {"dense_linear": dense, "budget": budget, "formats": {}}
    for fmt in formats:
        rank, params = rank_for(fmt, shapes, budget)
        out["formats"][fmt] = {"rank": rank, "linear_params": params,
                               "compression": dense / params, "fits": rank > 0}
    return out


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
    the_plan = plan(task, args.formats, args.target)
    path = args.out / "formats.json"
    result = {"task": "reviews (title, review) -> recommended, SmallReviews (d_model 128, "
                      "2 layers)", "data": task.describe(),
              "settings": vars(args) | {"out": str(args.out)}, "machine": machine(),
              "plan": the_plan, "rows": []}
    if args.append and path.is_file():
        result["rows"] = json.loads(path.read_text())["rows"]
    lr = {"cores": args.lr, "gates": args.lr_gates, "other": args.lr}

    def save() -> None:
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, default=str) + "\n")
        (args.out / "formats.md").write_text(summarise(result) + "\n")

    save()
    for seed in args.seeds:
        stream = IndexStream(task.train_size(), args.batch, seed)
        for name in [*args.formats, "dense"]:
            if any(r["seed"] == seed and r["model"] == name for r in result["rows"]):
                continue
            if name != "dense" and not the_plan["formats"][name]["fits"]:
                continue
            start = time.time()
            if name == "dense":
                torch.manual_seed(seed)
                model = task.build_model(tt=False)
                opt = torch.optim.AdamW([{"params": list(model.parameters()), "lr": args.lr,
                                          "name": "other"}], weight_decay=0.0)
                trainer = comera.DenseTrainer(model, opt, 1.0)
                rank = None
            else:
                rank = the_plan["formats"][name]["rank"]
                model = build_model(task, name, rank, seed)
                trainer = comera.CoMERATrainer(model, _tt_optimizer(model, args), 0.0,
                                               max_grad_norm=1.0)
            _train(task, model, trainer, stream, 0, args.steps, args.warmup, lr)
            score = _score(task, model)
            result["rows"].append({"seed": seed, "model": name, "rank": rank,
                                   "seconds": round(time.time() - start, 1), **score})
            save()
            print(f"seed {seed} {name}: test {score['test']['accuracy']:.4f} "
                  f"({score['linear_compression']:.1f}x, {result['rows'][-1]['seconds']} s)",
                  flush=True)
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
    if args.steps < 1 or args.warmup < 1:
        p.error(f"--steps {args.steps} --warmup {args.warmup}: both must be >= 1")
    if args.smoke:
        args.steps, args.warmup = 2, 1
    torch.set_num_threads(args.threads)
    if args.summarise_only:
        result = json.loads((args.out / "formats.json").read_text())
    else:
        try:
            result = run(args)
        except ConfigError as err:
            p.error(str(err))
    print(summarise(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
