r"""The compression frontier of the language-model tasks (issues 23, 30): every method of
:mod:`.methods` at matched size of the block linear layers, on the same rows, steps, batches,
seeds and schedule, each method at its best learning rate of one shared grid.

A task script (``benchmarks/studies/lm_frontier.py``, ``benchmarks/studies/mlm_frontier.py``)
gives a :class:`Spec`; this module trains (through :class:`~.methods.Study`), scores, merges and
reports. The task offers ``build(format, rank=None, **sizes)``, ``block_linears(model)``,
``evaluate(model, split)`` (a dict with "loss" and "perplexity"), ``describe()`` and
``train_size()``.

Methods (``--methods``): ``dense``, ``narrow`` (with ``--widths``: dense at those d_model
widths, rows ``dense@<width>``), ``comera`` (its early model is a row too, ``comera early``),
``comera@<format>`` (CoMERA on that format, from its largest rank that compresses, or
``--comera-start``), ``spectrum``, ``early``, and any registered format (``tt``, ``ttm``,
``btt``, ``lowrank`` ...; ``fixed`` is ``tt``, its name before the formats). Compression: dense
parameters / parameters at the effective ranks of the block linear layers (biases included where
the model has them). ``--lrs``: the grid; every method trains at every rate, and the tables show
each method at the rate of its best mean validation loss. ``--schedule cosine``, ``--optimizer
adamw`` (plain AdamW over ``model.parameters()``, what a user does) and ``--eval-every`` are the
engine's. Every row holds its curves (training loss per step; validation loss and perplexity at
each evaluation, against the step and the measured training wall-clock) in the runs files
(``curves/runs/<tag>.json``, git-ignored). Results: ``frontier.json`` (the rows without
curves), ``frontier.md``, ``frontier.png`` (loss vs compression) and ``frontier_curves.png``
(loss vs step and vs wall-clock at the first target; redrawn only where every row's curves are
in this checkout).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.studies.harness import equal_time
from benchmarks.studies.harness.equal_time import budget_entry, clock_key, steps_from_clock
from benchmarks.studies.harness.methods import (
    Study,
    check_method,
    is_adaptive,
    kind_title,
    split_method,
)
from benchmarks.studies.harness.results import (
    RunsFile,
    at_best_lr,
    by_method,
    mean_sd,
    merge,
    plot_curves,
    plot_points,
    write_summary,
)
from comera.errors import ConfigError
from comera.experiments.engine import EngineConfig
from comera.experiments.optim_schedule import OPTIMIZERS, SCHEDULES
from comera.experiments.task_config import config_keywords
from comera.formats.registry import get_format
from comera.ranks.allocate import FLOORS, check_chain_format
from comera.ranks.objective import ALLOCATIONS
from tncomp.files import atomic_write_text

ALIASES = {"fixed": "tt"}  # method names before the formats
FIXED = {"comera early": "CoMERA early stage", "comera": "CoMERA (early + late)",
         "spectrum": "CoMERA (spectrum allocation, restart)", "dense": "dense",
         "narrow": "narrower dense, same size", "early": "CoMERA early stage to the target",
         "lowrank-ungated": "low-rank x@A@B (ungated LowRankLinear, before the lowrank format)"}
_ORDER = ("dense", "narrow", "comera early")


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


#: The parametrization of a study's models where the method names none.
STUDY_PARAMETRIZATION = "plain"

def task_config(config_class, args):
    """The task's quick config at ``--max-rank`` (``--d-model`` / ``--d-ff`` wider, the FFN at
    4 d_model unless given); with ``--smoke`` a tiny model (d_model 16, one block, 16 tokens, 8
    evaluation rows)."""
    # the studies' rows were measured with plain cores unless a method names its parametrization
    # (tt:balanced): pinned, so a committed command gives its rows after the library's default
    # became balanced (comera.formats.scaling.FRESH)
    plain = {"parametrization": STUDY_PARAMETRIZATION}
    if args.smoke:
        return config_class(seq_len=16, vocab_size=64, d_model=16, n_heads=2, d_ff=32,
                            n_layers=1, rank=args.max_rank, eval_limit=8, **plain)
    sizes = {}
    if args.d_model:
        sizes = {"d_model": args.d_model, "d_ff": args.d_ff or 4 * args.d_model}
    elif args.d_ff:
        sizes = {"d_ff": args.d_ff}
    if args.tt_order is not None:
        if "tt_order" not in config_keywords(config_class):
            print(f"--tt-order {args.tt_order}: the {config_class.__name__} task has no modes "
                  "per side to set; drop --tt-order.", file=sys.stderr)
            raise SystemExit(2)  # as a bad flag: before any data is read or file written
        sizes["tt_order"] = args.tt_order
    return config_class(rank=args.max_rank, **sizes, **plain)


def label(method: str) -> str:
    """A method's name in tables and plots."""
    if method in FIXED:
        return FIXED[method]
    head, _, stage = method.partition(" ")  # "comera@btt:plain early"
    name, fmt, parametrization = split_method(head)
    extra = f" ({parametrization} parametrization)" if parametrization else ""
    if name == "comera":
        on = f" on {get_format(fmt).title}" if fmt else ""
        return f"{FIXED[f'comera {stage}'.strip()]}{on}{extra}"
    if name == "dense" and fmt:
        return f"dense, d_model {fmt}"
    return f"{kind_title(name)} at a uniform rank{extra}"


def upgrade(row: dict) -> dict:
    """A row as today's methods name it: ``fixed`` is ``tt``; the ungated LowRankLinear rows of
    before the lowrank format keep a name of their own."""
    method = ALIASES.get(row["method"], row["method"])
    if method == "lowrank" and "format" not in row:
        method = "lowrank-ungated"
    return row | {"method": method}


def _order(method: str) -> int:
    return _ORDER.index(method) if method in _ORDER else len(_ORDER)


# -- training ------------------------------------------------------------------------------------
def study(spec: Spec, args, task, clock: dict | None = None) -> Study:
    """The study of ``args``: its engine settings, steps and CoMERA settings; with
    ``--equal-time``, each model's steps from ``clock`` (the ``--clock`` file, read)."""
    config = EngineConfig(batch_size=args.batch, lr=args.lr, lr_gates=args.lr_gates,
                          warmup=args.warmup, eval_every=args.eval_every, max_grad_norm=1.0,
                          threads=args.threads, optimizer=args.optimizer, schedule=args.schedule,
                          late_allocation=args.late_allocation, late_landing=args.late_landing)
    steps_of = None
    if args.equal_time:
        sizes = {"d_model": task.config.d_model, "batch": args.batch}
        if any(clock.get(k) != v for k, v in sizes.items()):
            _refuse(f"--clock {args.clock} timed d_model {clock.get('d_model')}, batch "
                    f"{clock.get('batch')}; this study trains d_model {sizes['d_model']}, batch "
                    f"{sizes['batch']}: measure its models with python -m "
                    "benchmarks.studies.lm_clock --d-model ... --batch ...")
        steps_of = steps_from_clock(clock, args.early + args.late, args.evals)
    try:
        plan = Study(task, config, args.work, steps=args.early + args.late, early=args.early,
                     decide=args.decide, lam=args.lam, max_rank=args.max_rank,
                     floor=args.floor, resume=args.resume, steps_of=steps_of, evals=args.evals,
                     comera_start=args.comera_start, widths=tuple(args.widths))
    except ConfigError as exc:
        _refuse(f"{exc} (--widths / --comera-start)")
    for method in args.methods:  # each CoMERA run can start and reach its targets
        base, fmt, _ = split_method(method)
        if base == "comera":
            try:
                plan.check_comera(fmt or "tt", args.targets, method)
            except ConfigError as exc:
                _refuse(str(exc))
    if args.equal_time:
        check_clock(plan, args, clock)
    return plan


def check_clock(plan: Study, args, clock: dict) -> None:
    """Exit 2 before any training when the ``--clock`` file lacks a model the study trains
    on a step budget, naming it and the lm_clock command that times it."""
    times = clock["results"]
    for method in args.methods:
        for row_method, target in plan.runs_of(method, args.targets):
            key = clock_key(row_method, target)
            if key in times:
                continue
            fix = (f"--widths {' '.join(map(str, plan.widths))}" if row_method.startswith(
                "dense@") else f"--targets {' '.join(f'{t:g}' for t in args.targets)}")
            _refuse(f"--clock {args.clock} has no step time for {key!r} (method {method}; it "
                    f"has {', '.join(times)}): time it with python -m "
                    f"benchmarks.studies.lm_clock --d-model {clock.get('d_model')} --batch "
                    f"{clock.get('batch')} {fix}")


def _refuse(message: str):
    """A bad setting found before any file is written: one line on stderr, exit 2."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def run(spec: Spec, args, plan: Study, runs: RunsFile, clock: dict | None = None,
        baseline: dict | None = None) -> None:
    """Train and score every (seed, learning rate, method, target) of ``args`` on ``plan``
    (``clock``: the ``--clock`` file, read; ``baseline``: the equal-time report's
    majority-class scores)."""
    for seed in args.seeds:
        for lr in args.lrs:
            for method in args.methods:
                rows = plan.method(method, args.targets, seed, lr)
                if args.equal_time:
                    rows = [r | {"budget": budget_entry(r, clock)} for r in rows]
                runs.add(rows)
                write_report(spec, args.out, clock, baseline)
                for r in rows:
                    print(f"seed {seed} lr {lr:g} {r['method']} {r['target']}: val loss "
                          f"{r['val']['loss']:.4f}, test loss {r['test']['loss']:.4f} "
                          f"({r['compression']:.1f}x, {r['seconds']:.0f}s)", flush=True)


# -- reporting -----------------------------------------------------------------------------------
def chosen(result: dict) -> dict[tuple, tuple[list[dict], str]]:
    """Per (target, method): the rows at the method's best learning rate, and how it was
    chosen (on the validation loss)."""
    return {key: at_best_lr(rows, lambda r: r["val"]["loss"])
            for key, rows in by_method(result["rows"]).items()}


def summarise(spec: Spec, result: dict) -> str:
    """The frontier table (mean ± sd over seeds per method and target, each at its best
    learning rate), CoMERA's per-layer ranks next to the uniform rank, the machine and the
    commands."""
    data = result["data"]
    lines = [f"{spec.title}: train {data.get('train')} rows, val {data.get('val')}, test "
             f"{data.get('test')} (of {data.get('seq_len')} tokens, split by module); "
             f"vocabulary {data.get('vocab')}. Each method at the learning rate of its best mean "
             "validation loss.", "",
             "| target | method | seeds | lr | val loss (mean ± sd) | val ppl | val vs dense "
             "| test loss (mean ± sd) | test vs dense | linear compression | uniform rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    groups = chosen(result)
    dense_rows = next((rows for (t, m), (rows, _) in groups.items() if m == "dense"), [])
    dense = {s: statistics.fmean(r[s]["loss"] for r in dense_rows) if dense_rows
             else float("nan") for s in ("val", "test")}

    def vs_dense(losses: list[float], split: str) -> str:  # "-" in a study without dense
        return f"{statistics.fmean(losses) / dense[split] - 1:+.2%}" if dense_rows else "-"

    for (target, method), (rows, lr) in sorted(groups.items(), key=lambda kv: (
            kv[0][0] or 0, _order(kv[0][1]), kv[0][1])):
        val = [r["val"]["loss"] for r in rows]
        test = [r["test"]["loss"] for r in rows]
        ppl = statistics.fmean(r["val"]["perplexity"] for r in rows)
        comp = statistics.fmean(r["compression"] for r in rows)
        rank = sorted({r["rank"] for r in rows if "rank" in r})
        width = sorted({f"d {r['d_model']}, ff {r['d_ff']}" for r in rows if "d_model" in r})
        lines.append(
            f"| {f'{target:g}x' if target else '-'} | {label(method)} | "
            f"{len(rows)} (seeds {','.join(str(r['seed']) for r in rows)}) | {lr} | "
            f"{mean_sd(val)} | {ppl:.1f} | {vs_dense(val, 'val')} | "
            f"{mean_sd(test)} | {vs_dense(test, 'test')} | "
            f"{comp:.1f}x | {','.join(map(str, rank)) or '; '.join(width) or '-'} |")
    adaptive = [m for (t, m) in groups if t is not None
                and split_method(m)[0] in ("comera", "spectrum")]
    for method in dict.fromkeys(sorted(adaptive)):  # "comera", "comera@btt:plain", "spectrum"
        picked = sorted((r for (t, m), (rows, _) in groups.items() if m == method for r in rows),
                        key=lambda r: (r["target"], r["seed"]))
        fmt = split_method(method)[1] or "tt"
        title = get_format(fmt).title
        lines += ["", f"{label(method)}: per-layer {title} ranks (interior bonds) at each "
                  f"target, first seed, next to the uniform {title} rank:", ""]
        seen = set()
        for row in picked:
            if row["target"] in seen:
                continue
            seen.add(row["target"])
            fixed = [r.get("rank") for r in result["rows"]
                     if r["method"].partition(":")[0] == fmt and r["target"] == row["target"]]
            chain = _is_chain(fmt)
            lines.append(f"- {row['target']:g}x (seed {row['seed']}, uniform {title} rank "
                         f"{fixed[0] if fixed else '?'}): " + "; ".join(
                             f"{n}: {r[1:-1] if chain else r}" for n, r in row["ranks"].items()))
    if result["runs"]:
        m = result["runs"][-1]["machine"]
        lines += ["", f"Machine: {m['cpu']}, torch {m['torch']}, {m['threads']} thread(s); "
                  "commands:", ""] + [f"    {r['command']}" for r in result["runs"]]
    return "\n".join(lines)


def _is_chain(fmt: str) -> bool:
    """Whether ``fmt``'s layers state their ranks with the chain's ends (``(1, r1 .. , 1)``)."""
    f = get_format(fmt)
    modes = (2, 2) if f.uses_modes else (4,)
    return f.layout(modes, modes, 2).is_chain


def _clocked(rows: list[dict], ms: float) -> list[dict]:
    """``rows`` with each evaluation's wall-clock replaced by its step times ``ms`` (rows
    without curves here as they are)."""
    return [r | {"curves": r["curves"] | {"val": [[s, s * ms / 1000, scores] for s, _, scores
                                                 in r["curves"]["val"]]}}
            if r.get("curves") else r for r in rows]


def plot(spec: Spec, result: dict, out: Path, clock: dict | None = None) -> None:
    """Loss on ``spec.split`` vs compression (one point per seed, each method at its best
    rate), and the validation curves at the first target against step and wall-clock: the
    runs' own measured seconds, or with ``clock`` (an ``lm_clock`` results file) each step at
    its model's median step time, measured side by side (methods it has no time for left out)."""
    groups = chosen(result)
    split = spec.split
    dense = [r[split]["loss"] for (t, m), (rows, _) in groups.items() if m == "dense"
             for r in rows]
    lines = ()
    if dense:
        pct = 3 if spec.name == "lm" else 5
        lines = ((f"dense + {pct}%", statistics.fmean(dense) * (1 + pct / 100)),)
    series: dict[str, list] = {}
    for (target, method), (rows, _) in groups.items():
        if target is not None:
            series.setdefault(label(method), []).extend(
                (r["compression"], r[split]["loss"]) for r in rows)
        elif method.startswith("dense@"):  # the dense frontier's given widths: one series
            series.setdefault("dense at other widths", []).extend(
                (r["compression"], r[split]["loss"]) for r in rows)
    plot_points(series, out / "frontier.png", title=f"{spec.title}\n{split} loss vs "
                "compression (one point per seed)",
                xlabel="compression of the block linear layers (dense / parameters)",
                ylabel=f"{split} loss (cross-entropy)", reference=("dense", dense), lines=lines)
    targets = sorted({t for t, _ in groups if t is not None})
    if targets:
        curves = {label(m): rows for (t, m), (rows, _) in groups.items()
                  if t in (None, targets[0]) and not m.endswith(" early")}
        time_label = "training wall-clock (s, this CPU)"
        if clock is not None:
            times = clock["results"]
            curves = {label(m): _clocked(rows, times[clock_key(m, t)]["ms"])
                      for (t, m), (rows, _) in groups.items()
                      if t in (None, targets[0]) and clock_key(m, t) in times}
            time_label = (f"steps x the median step time side by side (s; {clock['machine']['cpu']}"
                          f", {clock['machine']['threads']} thread)")
        plot_curves(curves, out / "frontier_curves.png", metric="loss", time_label=time_label,
                    title=f"{spec.title}: validation loss at {targets[0]:g}x (mean over seeds)")


def write_report(spec: Spec, out: Path, clock: dict | None = None,
                 baseline: dict | None = None) -> dict:
    """frontier.{json,md,png}, and where rows trained at equal wall-clock, equal_time.{md,png}
    (``clock``: an ``lm_clock`` results file, read; ``baseline``: the majority-class scores the
    report states)."""
    result = merge(out, spec.title, upgrade)
    write_summary(out / "frontier.json", result, curves=False)  # the runs files hold them
    atomic_write_text(out / "frontier.md", summarise(spec, result) + "\n")
    plot(spec, result, out, clock)
    if any(r.get("budget") for r in result["rows"]):
        atomic_write_text(out / "equal_time.md", equal_time.summarise(result, label, baseline))
        equal_time.plot(result, out / "equal_time.png", label)
    return result


def parse(spec: Spec, argv=None, doc: str | None = None) -> argparse.Namespace:
    d = {"early": 300, "late": 150, "batch": 16, "lr": 2e-3, "lr_gates": 1e-2, "lam": 0.02,
         "warmup": 50, "max_rank": 32, "decide": 112, "targets": [8, 4, 16, 32],
         "eval_every": 75} | spec.defaults
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--targets", type=float, nargs="+", default=d["targets"])
    p.add_argument("--methods", nargs="+", default=["dense", "tt", "lowrank", "comera"],
                   help="dense, narrow, a format (tt, ttm, btt, lowrank ...) at a uniform "
                        "rank, a format with :<parametrization> (btt:balanced), comera (TT), "
                        "comera@<format>[:<parametrization>], spectrum, early")
    p.add_argument("--widths", type=int, nargs="+", default=[],
                   help="narrow: dense at these d_model widths (multiples of the heads, the "
                        "FFN at the task's ratio) instead of the targets' narrower models")
    p.add_argument("--comera-start", type=float, default=None,
                   help="comera@<format> (and comera): the early model at the largest uniform "
                        "rank that compresses at least this much (default: comera@<format> "
                        "the largest that compresses at all, comera --max-rank); at most "
                        "--max-rank")
    p.add_argument("--early", type=int, default=d["early"])
    p.add_argument("--late", type=int, default=d["late"])
    p.add_argument("--decide", type=int, default=d["decide"],
                   help="spectrum: steps at --max-rank before the allocation fixes the shape")
    p.add_argument("--late-allocation", choices=ALLOCATIONS, default="prune",
                   help="comera: the late stage prunes along its steps, or fixes the final "
                        "shape from the bonds' spectra when it starts")
    p.add_argument("--late-landing", type=float, default=0.75,
                   help="comera, pruning: the fraction of the late steps after which it is on "
                        "the target")
    p.add_argument("--floor", choices=FLOORS, default="uniform",
                   help="spectrum: the allocation starts from the uniform ranks or from rank 1")
    p.add_argument("--batch", type=int, default=d["batch"])
    p.add_argument("--lr", type=float, default=d["lr"])
    p.add_argument("--lrs", type=float, nargs="+", default=None,
                   help="a learning-rate grid every method trains at (default: --lr alone)")
    p.add_argument("--lr-gates", type=float, default=d["lr_gates"])
    p.add_argument("--lam", type=float, default=d["lam"])
    p.add_argument("--warmup", type=int, default=d["warmup"])
    p.add_argument("--schedule", choices=SCHEDULES, default="constant")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="groups")
    p.add_argument("--eval-every", type=int, default=d["eval_every"])
    p.add_argument("--max-rank", type=int, default=d["max_rank"],
                   help="CoMERA's starting TT rank")
    p.add_argument("--d-model", type=int, default=None,
                   help="the model's width (default: the task's quick config)")
    p.add_argument("--d-ff", type=int, default=None,
                   help="the FFN's width (default: 4 d_model with --d-model)")
    p.add_argument("--tt-order", type=int, default=None,
                   help="modes per side of the block layers in mode formats (TT's d; default: "
                        "the task's, 3)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--root", type=Path, default=None,
                   help="a folder of .py files to read instead of the standard library")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny model (d_model 16, 1 block, 16 tokens) for a fast test")
    p.add_argument("--tag", default="run",
                   help="this call's rows go to <out>/curves/runs/<tag>.json")
    p.add_argument("--out", type=Path, default=spec.out)
    p.add_argument("--work", type=Path, default=Path(f"/tmp/{spec.name}_frontier_work"),
                   help="the engine's run folder (a checkpoint per model)")
    p.add_argument("--resume", action="store_true",
                   help="read back the models --work holds finished (and go on with cut-off "
                        "ones) instead of training them again")
    p.add_argument("--summarise-only", action="store_true")
    p.add_argument("--clock", type=Path, default=None,
                   help="an lm_clock results JSON: draw the wall-clock curves at its step times")
    p.add_argument("--equal-time", action="store_true",
                   help="with --clock: every model trains the steps its clock step time buys in "
                        "dense's --early + --late steps (evaluated at each 1/--evals of them); "
                        "dense, narrow and the formats only")
    p.add_argument("--evals", type=int, default=8,
                   help="with --equal-time: evaluations per run, at every 1/evals of its steps")
    args = p.parse_args(argv)
    if args.clock is not None and not args.clock.is_file():
        p.error(f"--clock {args.clock}: no such file; write one with "
                "python -m benchmarks.studies.lm_clock")
    args.methods = list(dict.fromkeys(ALIASES.get(m, m) for m in args.methods))
    for method in args.methods:
        try:
            check_method(method)
        except ConfigError as exc:
            p.error(f"--methods: {exc}")
    if args.late_allocation == "spectrum":
        for method in args.methods:
            base, fmt, _ = split_method(method)
            if base == "comera" and fmt:
                try:
                    check_chain_format(fmt)
                except ConfigError as exc:
                    p.error(f"--late-allocation spectrum with --methods {method}: {exc} "
                            "(--late-allocation prune runs on every format)")
    if args.widths and "narrow" not in args.methods:
        p.error(f"--widths {' '.join(map(str, args.widths))}: they are the narrow method's "
                "widths; add narrow to --methods")
    if any(w < 1 for w in args.widths):
        p.error(f"--widths {' '.join(map(str, args.widths))}: each a d_model of at least 1")
    if args.comera_start is not None:
        if not any(split_method(m)[0] == "comera" for m in args.methods):
            p.error(f"--comera-start {args.comera_start:g}: it sets where comera starts; add "
                    "comera or comera@<format> to --methods")
        if not 1 < args.comera_start < min(args.targets):
            p.error(f"--comera-start {args.comera_start:g}: give a compression above 1 and "
                    f"below every target (the smallest is {min(args.targets):g}), so the late "
                    "stage prunes toward each")
    if args.equal_time:
        if args.clock is None:
            p.error("--equal-time needs --clock: an lm_clock results JSON of these models")
        adaptive = [m for m in args.methods if is_adaptive(m)]
        if adaptive and not args.summarise_only:
            p.error(f"--equal-time with --methods {' '.join(adaptive)}: their step time changes "
                    "as their ranks fall, so no one clock gives their steps; run them without "
                    "--equal-time")
        if args.evals < 1:
            p.error(f"--evals {args.evals}: give at least 1")
    args.lrs = args.lrs or [args.lr]
    if args.smoke:
        args.early, args.late = min(args.early, 4), min(args.late, 3)
        args.decide = min(args.decide, 2)
    if not 0 < args.decide < args.early + args.late:
        p.error(f"--decide {args.decide}: give a step count in (0, early + late)")
    if not 0 < args.early < args.early + args.late:
        p.error(f"--early {args.early} --late {args.late}: give both at least 1")
    if any(v is not None and v < 1 for v in (args.d_model, args.d_ff, args.tt_order)):
        p.error(f"--d-model {args.d_model} --d-ff {args.d_ff} --tt-order {args.tt_order}: "
                "each at least 1")
    if not 0 < args.late_landing <= 1:
        p.error(f"--late-landing {args.late_landing}: give a fraction in (0, 1]")
    if args.threads < 1 or args.eval_every < 1:
        p.error(f"--threads {args.threads} --eval-every {args.eval_every}: both at least 1")
    if any(t <= 1 for t in args.targets) or any(lr <= 0 for lr in args.lrs):
        p.error("--targets above 1 and --lrs above 0")
    return args


def main(spec: Spec, argv=None, doc: str | None = None) -> int:
    """Parse, train (unless ``--summarise-only``), write the runs file and the report."""
    args = parse(spec, argv, doc)
    torch.set_num_threads(args.threads)
    clock = None if args.clock is None else json.loads(args.clock.read_text())
    task = spec.make_task(args) if not args.summarise_only or args.equal_time else None
    baseline = equal_time.unigram_scores(task) if args.equal_time else None
    if not args.summarise_only:
        plan = study(spec, args, task, clock)  # checks the clock before any file is written
        runs = RunsFile(args.out, args.tag, f"benchmarks.studies.{spec.name}_frontier",
                        task.describe(), vars(args), argv)
        runs.save()
        run(spec, args, plan, runs, clock, baseline)
    print(summarise(spec, write_report(spec, args.out, clock, baseline)))
    return 0
