r"""Compress a trained model (issue 31): calibrated decompositions and one global rank budget,
against today's per-layer uniform target, on the project's causal LM and masked LM.

    python -m benchmarks.studies.compress_trained pretrain --task lm
    python -m benchmarks.studies.compress_trained compress --task lm --formats tt lowrank ttm \
        --targets 1.5 2 3 4 --seeds 0 1 2 --tag lm-before
    python -m benchmarks.studies.compress_trained compress --task lm --formats tt lowrank \
        --targets 2 --seeds 0 1 2 --finetune 200 --tag lm-ft
    python -m benchmarks.studies.compress_trained compress --task lm --formats tt lowrank \
        --targets 2 4 --seeds 0 --finetune 200 --ft-lrs 3e-4 1e-3 3e-3 \
        --parametrizations plain balanced --tag lm-grid
    python -m benchmarks.studies.compress_trained compress --task lm --formats tt lowrank \
        --targets 2 4 --seeds 1 2 --finetune 200 --at-best --tag lm-best
    python -m benchmarks.studies.compress_trained report

``pretrain`` trains the quick dense model of the task (``comera train lm|mlm --quick`` sizes)
through the engine (:func:`comera.experiments.engine.train_model`) for ``--steps`` steps and
keeps it, with its validation curve, under ``--cache`` (default ``runs/compress_trained``): a
function of the command and its seed, trained once. ``compress`` loads it and, per format, target
and calibration seed, converts the block linear layers (``include=["blocks.*"]``) these ways:

- ``dense`` (a control, with ``--finetune``): the pretrained model fine-tuned as long, at
  each rate (one model whatever the format and target; its rows sit in the cell run);
- ``narrow`` (a control, with ``--finetune``): the widest dense model of the task within the
  uniform/plain conversion's size, all parameters counted, trained from scratch at each rate
  for the pretraining and fine-tune steps together;
- ``uniform/plain``: ``convert_`` as before issue 31, every layer at its own target;
- ``uniform/calibrated``: the same ranks, decomposed on the calibration inputs;
- ``global/plain``: one budget (the uniform arm's parameter count) spent on the bond slices of
  most weight energy per parameter;
- ``global/calibrated``: one budget, whitened spectra, calibrated decompositions;
- ``global/calibrated+gates``: global/calibrated at ``--gate-headroom`` times the budget, then
  CoMERA's late stage (rank gates, ``comera.LateStage``) on the calibration rows for
  ``--gate-steps`` steps, landing on the budget;
- ``sensitivity/calibrated`` (issue 41): one budget spent by the model's measured loss on the
  calibration batches (the LM's next-token loss; the MLM's masked-token loss, its batches
  carrying their labels) with each layer alone decomposed at candidate ranks
  (``allocation="sensitivity"``), uniform's ranks kept where they measure lower.

Calibration: ``--calib-rows`` training rows drawn with the seed (batches of 32). Scores: the
task's validation loss and perplexity right after compression and, with ``--finetune N``, after
N steps of training through the engine (the same steps and batches for every arm; at most 10%
of the pretraining steps). The fine-tune grid (issue 41): ``--parametrizations`` converts each
arm at each parametrization and ``--ft-lrs`` fine-tunes each conversion at each rate;
``--at-best`` then fine-tunes each arm only at its best cell of the grid already under
``--out`` (screen the grid on one seed, repeat the best on more). The report holds every arm at
its best cell and each grid, its best bold and a best at the grid's edge flagged. Rows
go to ``<out>/runs/<tag>.json``; ``report`` merges
every runs file into ``summary.md``, ``summary.json`` and ``perplexity.png``.

``hf`` proves the dict-input path: a GPT-2 built from a config (random init, trained briefly
in-process through the engine), calibrated with ``{"input_ids": ...}`` batches. ``gpt2-124m``
converts a 124M-parameter GPT-2-sized config with calibration and records the peak RSS.
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import json
import math
import shlex
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import comera
from benchmarks.lib.measure import timed
from benchmarks.studies.harness.trained import (
    CALIB_BATCH,
    CONVERTIBLE,
    OUT,
    ForEngine,
    Grid,
    MaskedLMLoss,
    best_cell,
    calibration_batches,
    calibration_rows,
    compression_target,
    engine_run,
    grid_table,
    labelled_batches,
    linear_sizes,
    make_task,
    next_token_loss,
    score,
)
from comera.experiments.engine import EngineConfig, train_model
from comera.experiments.results import machine
from comera.experiments.task import Task
from comera.formats.scaling import PARAMETRIZATIONS
from comera.surgery.config import DEFAULT_DAMPING
from comera.surgery.convert import ConversionReport

CACHE = Path("runs/compress_trained")
#: The conversions (``compress``'s default arms).
ARMS = ("uniform/plain", "uniform/calibrated", "global/plain", "global/calibrated",
        "global/calibrated+gates", "sensitivity/calibrated")
#: The controls, asked for by name (``--arms dense narrow``, with ``--finetune``): the
#: pretrained model fine-tuned as long, and a narrower dense model of the uniform/plain
#: conversion's size (all parameters counted) trained from scratch for the pretraining and the
#: fine-tune steps together (:func:`narrow_model`, :func:`train_narrow`).
CONTROLS = ("dense", "narrow")
#: Every arm, in the report's order.
CHOICES = (*CONTROLS, *ARMS)
#: The controls' parametrization column: they have no cores to parametrize.
DENSE_CELL = "dense"
#: The arms that read the model's loss on the calibration batches (the MLM's: batches with
#: their labels, see :func:`labelled_batches`).
LOSS_ARMS = ("sensitivity/calibrated",)


# -- pretraining ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pretrain:
    """How the dense model is trained once (its key names the cached file)."""

    task: str
    steps: int = 4000
    batch: int = 32
    lr: float = 1e-3
    warmup: int = 100
    seed: int = 0
    eval_every: int = 250
    smoke: bool = False

    def key(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return f"{self.task}-dense-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


def pretrained(spec: Pretrain, cache: Path, root: Path | None = None,
               train: bool = True) -> tuple[nn.Module, dict[str, Any]]:
    """The dense model of ``spec`` and its record (validation curve, command), trained through
    the engine on the first call and read from ``cache`` after."""
    path = cache / f"{spec.key()}.pt"
    if path.is_file():
        saved = torch.load(path, weights_only=False)
        return saved["model"], saved["info"]
    if not train:
        raise SystemExit(f"{path} does not exist: run `python -m benchmarks.studies."
                         f"compress_trained pretrain --task {spec.task}` first")
    task = make_task(spec.task, spec.smoke, root)
    config = EngineConfig(steps_early=spec.steps, steps_late=0, stage="early",
                          batch_size=spec.batch, lr=spec.lr, warmup=spec.warmup,
                          eval_every=spec.eval_every, seed=spec.seed, threads=1,
                          max_grad_norm=1.0, format="dense")
    with tempfile.TemporaryDirectory() as out:
        (model, record), seconds, _ = timed(
            lambda: train_model(ForEngine(task), "dense", config, Path(out)))
    model.eval()
    info = {"spec": asdict(spec), "seconds": round(seconds, 1),
            "val_curve": record.val_curve, "stage_ends": record.stage_ends,
            "machine": machine(), "command": _command()}
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model, "info": info}, tmp)
    tmp.replace(path)
    return model, info


def _command() -> str:
    return "python -m benchmarks.studies.compress_trained " + shlex.join(sys.argv[1:])


def cmd_pretrain(args) -> int:
    spec = Pretrain(args.task, args.steps, args.batch, args.lr, args.warmup, args.seed,
                    args.eval_every, args.smoke)
    _, info = pretrained(spec, args.cache, args.root)
    for step, scores in info["val_curve"]:
        print(f"step {step:5d}: val loss {scores['loss']:.4f} perplexity "
              f"{scores.get('perplexity', math.exp(scores['loss'])):.2f}")
    print(f"{spec.key()}: {info['seconds']}s")
    return 0


# -- compression arms -----------------------------------------------------------------------------
def convert_arm(dense: nn.Module, fmt: str, arm: str, target: float, budget: int | None,
                batches: list[Tensor] | None, damping: float = DEFAULT_DAMPING,
                parametrization: str = "balanced") -> tuple[nn.Module, ConversionReport]:
    """A copy of ``dense`` with its block linear layers converted as ``arm`` says
    ("uniform|global|sensitivity" / "plain|calibrated"); the global and sensitivity arms spend
    ``budget`` core parameters (sensitivity measures the loss on ``batches``: the LM's
    next-token loss on its inputs; for (inputs, labels) batches, the MLM's masked-token loss
    through :class:`MaskedLMLoss`); the layers at ``parametrization``."""
    allocation, how = arm.split("+")[0].split("/")
    model = copy.deepcopy(dense)
    options = ({"target_compression": target} if allocation == "uniform"
               else {"allocation": allocation, "target_size": budget})
    labelled = allocation == "sensitivity" and bool(batches) and isinstance(batches[0], tuple)
    converted, prefix = (MaskedLMLoss(model), "model.") if labelled else (model, "")
    config = comera.ConvertConfig(include=[f"{prefix}blocks.*"], format=fmt, damping=damping,
                                  parametrization=parametrization, **options)
    extra = ({"loss": next_token_loss} if allocation == "sensitivity" and not labelled else {})
    report = comera.convert_(converted, config,
                             calibration=batches if how == "calibrated" else None, **extra)
    model.eval()
    return model, report


def narrow_model(task: Task, size: int) -> nn.Module:
    """The widest dense model of ``task``'s family (d_model a multiple of its heads, d_ff in
    the task's ratio to it) with at most ``size`` parameters in all, initialised from the
    current RNG: the narrower dense model of a conversion's size."""
    heads, width, ff = task.config.n_heads, task.config.d_model, task.config.d_ff
    for d in range(width - width % heads, 0, -heads):
        model = task.build("dense", d_model=d, d_ff=d * ff // width)
        if sum(p.numel() for p in model.parameters()) <= size:
            return model
    raise SystemExit(f"no {task.name} model of d_model {heads} or more fits {size:,} "
                     "parameters")


def train_narrow(task: Task, model: nn.Module, args, seed: int, lr: float) -> nn.Module:
    """``model`` trained from scratch as the dense model was pretrained (``--warmup``,
    gradient norm 1), for ``--steps`` + ``--finetune`` steps at ``lr``, batches of ``seed``."""
    config = EngineConfig(steps_early=args.steps + args.finetune, steps_late=0, stage="early",
                          batch_size=args.batch, lr=lr, warmup=args.warmup,
                          eval_every=args.steps + args.finetune + 1, seed=seed, threads=1,
                          max_grad_norm=1.0, format="dense")
    with tempfile.TemporaryDirectory() as out:
        trained, _ = train_model(ForEngine(task, model), "dense", config, Path(out))
    return trained.eval()


def core_params(model: nn.Module) -> int:
    """Parameters of the gated layers' cores at their stored ranks (biases excluded)."""
    return sum(m.layout.parameters_at(m.bond_sizes) for _, m in comera.gated_layers(model))


def refine_with_gates(task: Task, model: nn.Module, rows: Tensor, target_size: int, args,
                      seed: int) -> nn.Module:
    """CoMERA's late stage on the calibration rows: from ``model`` (converted with headroom) to
    ``target_size`` parameters of its gated layers (biases included) in ``--gate-steps``."""
    _, dense = linear_sizes(model)
    config = EngineConfig(steps_early=1, steps_late=args.gate_steps, stage="late", lam=0.0,
                          batch_size=min(CALIB_BATCH, rows.numel()), lr=args.ft_lr,
                          lr_gates=args.gate_lr, target_compression=dense / target_size,
                          eval_every=args.gate_steps + 1, seed=seed, threads=1,
                          late_allocation="prune")  # the gate refinement prunes
    return engine_run(task, model, config, rows)


def finetune(task: Task, model: nn.Module, steps: int, args, seed: int,
             lr: float | None = None, dense: bool = False) -> nn.Module:
    """``steps`` of plain training (lam 0, gates held) through the engine at rate ``lr``
    (default ``--ft-lr``), every arm alike (``dense``: the unconverted control)."""
    config = EngineConfig(steps_early=steps, steps_late=0, stage="early", lam=0.0,
                          batch_size=args.batch, lr=args.ft_lr if lr is None else lr,
                          lr_gates=1e-12,
                          warmup=min(args.warmup, steps), eval_every=steps + 1, seed=seed,
                          threads=1, **({"format": "dense"} if dense else {}))
    return engine_run(task, model, config)


def _sweep(args) -> tuple[list[str], list[float]]:
    """The parametrizations and fine-tune rates of the grid (``--parametrizations`` /
    ``--ft-lrs``, else the single ``--parametrization`` / ``--ft-lr``)."""
    return (args.parametrizations or [args.parametrization],
            args.ft_lrs or [args.ft_lr])


def _check_compress(args) -> None:
    """Refuse what cannot run, before anything is converted."""
    controls = [a for a in args.arms if a in CONTROLS]
    if controls and not args.finetune:
        raise SystemExit(f"--arms {' '.join(controls)}: a control is trained, not converted; "
                         "pass --finetune N (steps) too.")
    if (args.ft_lrs or args.parametrizations or args.at_best) and not args.finetune:
        raise SystemExit("--ft-lrs, --parametrizations and --at-best choose fine-tunes: pass "
                         "--finetune N (steps) too.")
    if args.at_best and (args.ft_lrs or args.parametrizations):
        raise SystemExit("--at-best fine-tunes each arm at its best cell of the grid measured "
                         "under --out; leave --ft-lrs and --parametrizations out.")


def best_cells(out: Path, task: str, fmt: str, target: float, steps: int,
               arms: list[str]) -> dict[str, tuple[str, float]]:
    """Per arm, the (parametrization, rate) of its lowest perplexity after ``steps`` fine-tune
    steps among the runs under ``out`` (judged on the seeds every cell holds: the screening
    seed); a clear error for an arm with none measured."""
    found = {}
    for arm in arms:
        grid = _grid([r for r in merge(out)["rows"]
                      if (r["task"], r["format"], r["target"], r["arm"], r.get("finetune"))
                      == (task, fmt, target, arm, steps)])
        if not grid:
            raise SystemExit(f"--at-best: no {task} {fmt} {target:g}x {arm} row fine-tuned "
                             f"{steps} steps under {out}; screen the grid first (--ft-lrs ... "
                             "--parametrizations ... --seeds 0).")
        found[arm] = best_cell({k: [a for _, a in v] for k, v in grid.items()})
    return found


def cmd_compress(args) -> int:
    args.arms = args.arms or list(ARMS)
    _check_compress(args)
    task = make_task(args.task, args.smoke, args.root)
    spec = Pretrain(args.task, args.steps, args.batch, args.lr, args.warmup, 0, args.eval_every,
                    args.smoke)
    dense, info = pretrained(spec, args.cache, args.root, train=args.smoke)
    chosen_cells = {(fmt, target): best_cells(args.out, args.task, fmt, target, args.finetune,
                                              args.arms)
                    for fmt in args.formats for target in args.targets} if args.at_best else {}
    own = args.out / "runs" / f"{args.tag}.json"
    own.parent.mkdir(parents=True, exist_ok=True)
    payload = {"tag": args.tag, "task": args.task, "data": task.describe(),
               "pretrain": {k: v for k, v in info.items() if k != "stage_ends"},
               "dense": score(task, dense), "machine": machine(), "command": _command(),
               "settings": {k: str(v) if isinstance(v, Path) else v
                            for k, v in vars(args).items() if k != "run"}, "rows": []}
    rows = payload["rows"]

    def save() -> None:
        tmp = own.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=1, default=str))
        tmp.replace(own)

    def one_arm(dense, fmt, target, arm, seed, budget, chosen, batches, parametrization,
                lrs) -> list[dict]:
        """Convert (and refine) one arm at ``parametrization``, then fine-tune it at each rate
        of ``lrs``: its rows (one, before fine-tuning only, without ``--finetune``)."""
        torch.manual_seed(seed)
        if arm == "dense":  # the control: the pretrained model fine-tuned as long
            model, report = copy.deepcopy(dense), None
        elif arm == "narrow":  # the control: a narrower dense model, from scratch
            base, _ = convert_arm(dense, fmt, "uniform/plain", target, None, None)
            torch.manual_seed(seed)
            model, report = narrow_model(task, comera.model_size(base)), None
        elif arm.endswith("+gates"):
            model, report = convert_arm(dense, fmt, arm, target,
                                        int(budget * args.gate_headroom), batches,
                                        args.damping, parametrization)
            goal = budget + sum(m.bias.numel() for _, m in comera.gated_layers(model)
                                if m.bias is not None)
            model = refine_with_gates(task, model, chosen, goal, args, seed)
        else:
            model, report = convert_arm(dense, fmt, arm, target, budget, batches,
                                        args.damping, parametrization)
        if report is not None:
            params, dense_params = linear_sizes(model)
        elif arm == "narrow":  # its whole size against the pretrained model's
            params = sum(p.numel() for p in model.parameters())
            dense_params = sum(p.numel() for p in dense.parameters())
        else:
            params = dense_params = sum(p.numel() for _, m in task.block_linears(model)
                                        for p in m.parameters())
        row = {"format": fmt, "target": target, "arm": arm, "seed": seed,
               "parametrization": parametrization,
               "params": params, "dense_params": dense_params,
               "compression": dense_params / params, "budget": budget,
               "calib_rows": args.calib_rows,
               "ranks": {n: list(m.ranks) for n, m in comera.gated_layers(model)},
               "errors": {} if report is None else {r.name: r.error for r in report.layers},
               "before": score(task, model),
               **({"d_model": model.cfg.d_model} if arm == "narrow" else {})}
        if not args.finetune:
            return [row]
        tuned_rows = []
        for lr in lrs:
            tuned = (train_narrow(task, model, args, seed, lr) if arm == "narrow" else
                     finetune(task, model, args.finetune, args, seed, lr, arm == "dense"))
            tuned_rows.append({**row, "after": score(task, tuned), "finetune": args.finetune,
                               "ft_lr": lr})
        return tuned_rows

    save()
    parametrizations, lrs = _sweep(args)
    for fmt in args.formats:
        for target in args.targets:
            base, _ = convert_arm(dense, fmt, "uniform/plain", target, None, None)
            budget = core_params(base)
            for seed in args.seeds:
                chosen = calibration_rows(task, seed, args.calib_rows)
                inputs = calibration_batches(task, chosen)
                labelled = labelled_batches(task, chosen) if args.task == "mlm" else inputs
                for arm in args.arms:
                    batches = labelled if arm in LOSS_ARMS else inputs
                    if "calibrated" not in arm and not args.finetune and seed != args.seeds[0]:
                        continue  # a plain arm before fine-tuning does not depend on the seed
                    cells = ([chosen_cells[fmt, target][arm]] if args.at_best else
                             [(DENSE_CELL, lrs)] if arm in CONTROLS else
                             [(p, lrs) for p in parametrizations])
                    for parametrization, arm_lrs in ((p, v if isinstance(v, list) else [v])
                                                     for p, v in cells):
                        new, seconds, _ = timed(functools.partial(
                            one_arm, dense, fmt, target, arm, seed, budget, chosen, batches,
                            parametrization, arm_lrs))
                        for row in new:
                            row["seconds"] = round(seconds / len(new), 1)
                            rows.append(row)
                            after = (f", after {row['after']['perplexity']:.2f} "
                                     f"(lr {row['ft_lr']:g})" if "after" in row else "")
                            print(f"{args.task} {fmt} {target:g}x {arm} {parametrization} seed "
                                  f"{seed}: {row['compression']:.2f}x, val ppl "
                                  f"{row['before']['perplexity']:.2f}{after}", flush=True)
                        save()
    return 0


# -- which calibrated start -----------------------------------------------------------------------
def cmd_starts(args) -> int:
    """Per format, the mean relative output error of the pretrained model's block linear layers
    (on one calibration set, at the uniform rank of ``--target``) for each start of the
    calibrated decomposition and after the refit: the measurement behind
    :mod:`comera.formats.whitened`'s choices."""
    from comera.formats.registry import get_format
    from comera.formats.tt import split_whitened
    from comera.formats.whitened import damped, kronecker_start, output_error, refit
    from comera.surgery.input_statistics import collect_input_stats

    task = make_task(args.task, args.smoke, args.root)
    spec = Pretrain(args.task, args.steps, args.batch, args.lr, args.warmup, 0, args.eval_every,
                    args.smoke)
    dense, _ = pretrained(spec, args.cache, args.root, train=args.smoke)
    batches = calibration_batches(task, calibration_rows(task, 0, args.calib_rows))
    linears = dict(task.block_linears(dense))
    stats, _ = collect_input_stats(dense, linears, batches)
    lines = [f"Relative output error of the {args.task} model's {len(linears)} block linear "
             f"layers at {args.target:g}x (uniform rank per layer), mean over layers; "
             f"calibration: {args.calib_rows} training rows, damping "
             f"{comera.ConvertConfig().damping}.", "",
             "| format | plain | Kronecker start | split start (TT) | best start | + refit "
             f"({args.sweeps} sweeps) |", "|---|---|---|---|---|---|"]
    for name in args.formats:
        fmt = get_format(name)
        sums: dict[str, float] = {}
        for layer_name, layer in linears.items():
            model = nn.Sequential(copy.deepcopy(layer))
            comera.convert_(model, comera.ConvertConfig(format=name,
                                                        target_compression=args.target))
            layout = model[0].layout
            w = layer.weight.detach().T.to(torch.float64)
            gram = damped(stats[layer_name].gram, comera.ConvertConfig().damping)
            raw = stats[layer_name].gram
            scale = output_error(w, torch.zeros_like(w), raw)
            starts = {"plain": fmt.decompose(w, layout),
                      "kron": kronecker_start(fmt, w, layout, gram),
                      "split": split_whitened(w, layout, gram) if name == "tt" else None}
            errors = {k: output_error(w, layout.dense(c), raw) / scale
                      for k, c in starts.items() if c is not None}
            best = min(errors, key=errors.get)
            fitted = refit(starts[best], layout, w, gram, args.sweeps)
            errors["best"] = errors[best]
            errors["refit"] = output_error(w, layout.dense(fitted), raw) / scale
            for k, v in errors.items():
                sums[k] = sums.get(k, 0.0) + v / len(linears)
        cells = [f"{sums[k]:.4f}" if k in sums else "-"
                 for k in ("plain", "kron", "split", "best", "refit")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"    {_command()}"]
    text = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"starts_{args.task}.md").write_text(text + "\n")
    print(text)
    return 0


# -- the report -----------------------------------------------------------------------------------
def merge(out: Path) -> dict:
    """Every ``runs/*.json`` under ``out``: rows (tagged with their task; one per task, format,
    target, arm, seed, parametrization and fine-tune rate and steps: a later run's row replaces
    an earlier one's), per task its dense scores and pretraining, and the commands. Rows written
    before the sweep name their run's ``--parametrization`` (balanced before it was recorded)
    and ``--ft-lr``."""
    runs = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]
    merged: dict[tuple, dict] = {}
    for r in runs:
        settings = r.get("settings", {})
        for row in r["rows"]:
            row = {**row, "task": r["task"],
                   "parametrization": (row.get("parametrization")
                                       or settings.get("parametrization") or "balanced"),
                   "ft_lr": row.get("ft_lr", settings.get("ft_lr")) if "after" in row else None}
            key = (r["task"], row["format"], row["target"], row["arm"], row["seed"],
                   row["parametrization"], row["ft_lr"], row.get("finetune"))
            merged[key] = row
    rows = list(merged.values())
    tasks = {r["task"]: {"dense": r["dense"], "data": r["data"], "pretrain": r["pretrain"]}
             for r in runs}
    return {"rows": rows, "tasks": tasks,
            "runs": [{k: r[k] for k in ("tag", "task", "command", "machine")} for r in runs]}


def _mean_sd(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(
        values) > 1 else 0.0
    return mean, sd


def _groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["format"], row["target"], row["arm"]), []).append(row)
    return groups


def _before(rows: list[dict]) -> list[float]:
    """Perplexity right after conversion, one per seed (the same at every fine-tune rate and
    either parametrization: they are one product of cores)."""
    seen: dict[int, float] = {}
    for row in rows:
        seen.setdefault(row["seed"], row["before"]["perplexity"])
    return list(seen.values())


def _grid(rows: list[dict]) -> Grid:
    """The fine-tune grid of one arm's rows: (parametrization, rate) -> (before, after) per
    seed, in seed order."""
    grid: Grid = {}
    for row in sorted((r for r in rows if "after" in r), key=lambda r: r["seed"]):
        grid.setdefault((row["parametrization"], row["ft_lr"]), []).append(
            (row["before"]["perplexity"], row["after"]["perplexity"]))
    return grid


def best_after(rows: list[dict]) -> tuple[tuple[str, float], list[float]] | None:
    """One arm's best fine-tune cell (parametrization, rate; judged on the seeds every cell
    holds) and its perplexities after fine-tuning, one per seed; None when none was measured."""
    grid = _grid(rows)
    if not grid:
        return None
    best = best_cell({k: [a for _, a in v] for k, v in grid.items()})
    return best, [a for _, a in grid[best]]


def summarise(result: dict) -> str:
    """The tables per task (validation perplexity before fine-tuning and after it, each arm at
    its best cell of the fine-tune grid, mean ± sd over seeds, change against uniform/plain at
    its own best), each fine-tune grid, the targets' check, the machine and commands."""
    groups = _groups(result["rows"])
    lines = []
    for task, info in sorted(result["tasks"].items()):
        dense = info["dense"]
        pre = info["pretrain"]
        curve = ", ".join(f"{step}: {scores['loss']:.3f}" for step, scores in pre["val_curve"])
        lines += [f"### {task.upper()}: dense validation perplexity {dense['perplexity']:.2f} "
                  f"(loss {dense['loss']:.4f})", "",
                  f"Pretrained dense through the engine, {pre['spec']['steps']} steps of batch "
                  f"{pre['spec']['batch']}, lr {pre['spec']['lr']} ({pre['seconds']:.0f} s); "
                  f"validation loss by step: {curve}.", "",
                  "After fine-tuning: each arm at its best cell (parametrization, rate) of the "
                  "grid measured, chosen on the seeds every cell holds; vs uniform/plain at its "
                  "own best.", "",
                  "| format | target | arm | seeds | compression | val ppl before | vs "
                  "uniform/plain | val ppl after fine-tune | best cell | vs uniform/plain |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        keys = sorted(k for k in groups if k[0] == task)
        for _, fmt, target, arm in sorted(keys, key=lambda k: (k[1], k[2], CHOICES.index(k[3]))):
            rows = groups[task, fmt, target, arm]
            base = groups.get((task, fmt, target, "uniform/plain"), [])
            before, ref = _before(rows), _before(base)
            mean, sd = _mean_sd(before)
            cells = (["from scratch", "-"] if arm == "narrow" else
                     [f"{mean:.2f} ± {sd:.2f}",
                      f"{mean / _mean_sd(ref)[0] - 1:+.1%}" if ref else "-"])
            best, ref_best = best_after(rows), best_after(base)
            if best is None:
                cells += ["-", "-", "-"]
            else:
                (p, lr), values = best
                mean, sd = _mean_sd(values)
                only = " (the only cell measured)" if len(_grid(rows)) == 1 else ""
                cells += [f"{mean:.2f} ± {sd:.2f}", f"{p}, {lr:g}{only}",
                          f"{mean / _mean_sd(ref_best[1])[0] - 1:+.1%}" if ref_best else "-"]
            seeds = ",".join(str(s) for s in sorted({r["seed"] for r in rows}))
            lines.append(f"| {fmt} | {target:g}x | {arm} | {seeds} | {_size_cell(arm, rows)} | "
                         + " | ".join(cells) + " |")
        lines.append("")
        for _, fmt, target in sorted({k[:3] for k in keys}):
            arms = {arm: _grid(groups[task, fmt, target, arm]) for arm in CHOICES
                    if (task, fmt, target, arm) in groups}
            arms = {arm: grid for arm, grid in arms.items() if grid}
            if any(len(grid) > 1 for grid in arms.values()):
                steps = sorted({r["finetune"] for arm in arms
                                for r in groups[task, fmt, target, arm] if "after" in r})
                lines += [f"Fine-tune grid, {task} {fmt} {target:g}x ({'/'.join(map(str, steps))}"
                          " steps; after: mean ± sd over seeds, their number in brackets where "
                          "the cells differ in it):", "",
                          grid_table(arms, pre["spec"]["lr"]), ""]
    lines += targets_text(groups)
    if result["runs"]:
        m = result["runs"][-1]["machine"]
        lines += ["", f"Machine: {m['cpu']}, torch {m['torch']}, {m['threads']} thread(s), "
                  f"commit {m.get('commit', '?')}; commands:", ""]
        lines += [f"    {r['command']}" for r in result["runs"]]
    return "\n".join(lines)


def _size_cell(arm: str, rows: list[dict]) -> str:
    """The summary's size cell: the block linears' compression for a conversion, the whole
    model's parameters for the narrower control (its embeddings shrink too, so a ratio of
    block linears does not describe it)."""
    if arm == "narrow":
        return f"{rows[0]['params']:,} parameters, whole model (d_model {rows[0]['d_model']})"
    return f"{sum(r['compression'] for r in rows) / len(rows):.2f}x"


#: The allocations the targets judge against uniform/plain (issue 31's, and issue 41's best).
CHALLENGERS = ("global/calibrated", "sensitivity/calibrated")


def targets_text(groups: dict[tuple, list[dict]]) -> list[str]:
    """Issue 31's and 41's targets, per task, format and target measured: each of
    :data:`CHALLENGERS` at least 15% lower perplexity than uniform/plain before fine-tuning,
    and after fine-tuning (each arm at its best cell) lower by more than the seeds' spread."""
    lines = ["Targets (against uniform/plain; after fine-tuning each arm at its best cell):", ""]
    for task, fmt, target in sorted({k[:3] for k in groups}):
        base = groups.get((task, fmt, target, "uniform/plain"), [])
        for arm in CHALLENGERS:
            ours = groups.get((task, fmt, target, arm), [])
            if not ours or not base:
                continue
            text = [f"- {task} {fmt} {target:g}x {arm}:"]
            before = _mean_sd(_before(ours))[0]
            ref = _mean_sd(_before(base))[0]
            cut = 1 - before / ref
            text.append(f"before fine-tuning {before:.2f} vs {ref:.2f} ({cut:.1%} lower; "
                        f"target 15%: {'met' if cut >= 0.15 else 'not met'})")
            ours_after, base_after = best_after(ours), best_after(base)
            if ours_after and base_after:
                (a, sa), (b, sb) = _mean_sd(ours_after[1]), _mean_sd(base_after[1])
                spread = max(sa, sb)
                verdict = ("not judged: one seed, no spread"
                           if min(len(ours_after[1]), len(base_after[1])) < 2
                           else "met" if b - a > spread else "not met")
                text.append(f"after fine-tuning {a:.2f} ± {sa:.2f} vs {b:.2f} ± {sb:.2f} (gap "
                            f"{b - a:.2f}, {1 - a / b:.1%}; spread {spread:.2f}: {verdict})")
            lines.append(" ".join(text[:1]) + " " + "; ".join(text[1:]) + ".")
    return lines


def plot(result: dict, path: Path) -> bool:
    """Validation perplexity against compression, one panel per task and format, one line per
    arm: filled markers right after compression, hollow after the fine-tune (means over
    seeds). False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(result["rows"])
    panels = sorted({(k[0], k[1]) for k in groups})
    if not panels:
        return False
    tasks = sorted({t for t, _ in panels})
    formats = sorted({f for _, f in panels})
    fig, axes = plt.subplots(len(tasks), len(formats), figsize=(4.2 * len(formats),
                                                                3.4 * len(tasks)), squeeze=False)
    colours = dict(zip(ARMS, ("tab:grey", "tab:blue", "tab:orange", "tab:red", "tab:purple",
                              "tab:green"), strict=True))
    for (task, fmt), ax in ((p, axes[tasks.index(p[0])][formats.index(p[1])]) for p in panels):
        tuned = [best_after(rows) for k, rows in groups.items() if k[:2] == (task, fmt)
                 and k[3] == "dense" and best_after(rows)]
        if tuned:  # the control: one dense model, fine-tuned as long, whatever the target
            ax.axhline(_mean_sd(tuned[0][1])[0], color="k", lw=0.8, ls="--",
                       label="dense, fine-tuned as long")
        narrow = sorted((k[2], best_after(rows)) for k, rows in groups.items()
                        if k[:2] == (task, fmt) and k[3] == "narrow" and best_after(rows))
        if narrow:  # the control: a narrower dense model of the size, from scratch
            ax.plot([t for t, _ in narrow], [_mean_sd(b[1])[0] for _, b in narrow], "x",
                    color="k", ms=6, label="narrower dense, from scratch")
        for arm in ARMS:
            points = sorted((k[2], rows) for k, rows in groups.items()
                            if k[:2] == (task, fmt) and k[3] == arm)
            if not points:
                continue
            for when, style in (("before", "-o"), ("after", "--o")):
                xy = [(target, _mean_sd(_before(rows) if when == "before"
                                        else best_after(rows)[1])[0])
                      for target, rows in points if when == "before" or best_after(rows)]
                if xy:
                    ax.plot(*zip(*xy, strict=True), style, color=colours[arm], ms=4,
                            mfc=colours[arm] if when == "before" else "none",
                            label=arm if when == "before" else None)
        dense = result["tasks"][task]["dense"]["perplexity"]
        ax.axhline(dense, color="k", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.set_title(f"{task} {fmt}", fontsize=9)
        ax.set_xlabel("target compression of the block linear layers", fontsize=8)
        ax.set_xticks(sorted({k[2] for k in groups if k[:2] == (task, fmt)}))
        ax.set_ylabel("validation perplexity", fontsize=8)
    for row in axes:
        for ax in row:
            if not ax.has_data():
                ax.axis("off")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Compressing a trained model: filled = right after, hollow = after the "
                 "fine-tune, dotted = dense;\nthe controls: dashed black = dense fine-tuned as "
                 "long, x = a narrower dense model of the size, trained from scratch",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


#: Per-layer fields of a row: kept in the runs files, left out of the summary (its size).
PER_LAYER = ("ranks", "errors")


def cmd_report(args) -> int:
    result = merge(args.out)
    summary = {**result, "rows": [{k: v for k, v in row.items() if k not in PER_LAYER}
                                  for row in result["rows"]]}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    text = summarise(result)
    (args.out / "summary.md").write_text(text + "\n")
    plot(result, args.out / "perplexity.png")
    print(text)
    return 0


def _model_options(q: argparse.ArgumentParser, pretrain: bool) -> None:
    """The options naming the pretrained model (``pretrain``: also those that train it)."""
    q.add_argument("--task", choices=("lm", "mlm"), required=True)
    q.add_argument("--steps", type=int, default=4000, help="pretraining steps")
    q.add_argument("--batch", type=int, default=32)
    q.add_argument("--lr", type=float, default=1e-3, help="pretraining learning rate")
    q.add_argument("--warmup", type=int, default=100)
    if pretrain:
        q.add_argument("--seed", type=int, default=0)
    q.add_argument("--eval-every", type=int, default=250)
    q.add_argument("--cache", type=Path, default=CACHE)
    q.add_argument("--root", type=Path, default=None,
                   help="a folder of .py files to read instead of the standard library")
    q.add_argument("--smoke", action="store_true", help="a tiny model, for tests")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("pretrain", help="train the dense model once (cached)")
    _model_options(pre, pretrain=True)
    pre.set_defaults(run=cmd_pretrain)
    com = sub.add_parser("compress", help="convert the pretrained model every way, score it")
    _model_options(com, pretrain=False)
    com.add_argument("--formats", nargs="+", default=["tt", "lowrank", "ttm"],
                     choices=CONVERTIBLE)
    com.add_argument("--targets", type=compression_target, nargs="+", default=[1.5, 2.0, 3.0, 4.0])
    com.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    com.add_argument("--arms", nargs="+", choices=CHOICES, default=None,
                     help="default: every arm the task supports")
    com.add_argument("--calib-rows", type=int, default=256)
    com.add_argument("--damping", type=float, default=DEFAULT_DAMPING)
    com.add_argument("--finetune", type=int, default=0, help="fine-tune steps after (0: none)")
    com.add_argument("--ft-lr", type=float, default=3e-4,
                     help="the fine-tune rate without --ft-lrs, and the gate refinement's")
    com.add_argument("--ft-lrs", type=float, nargs="+", default=None,
                     help="fine-tune at each rate (each conversion once, then one fine-tune "
                     "per rate)")
    com.add_argument("--parametrizations", nargs="+", choices=PARAMETRIZATIONS, default=None,
                     help="convert at each parametrization (the grid's other axis)")
    com.add_argument("--at-best", action="store_true",
                     help="fine-tune each arm only at its best (parametrization, rate) of the "
                     "grid already measured under --out (screen on one seed, then add seeds)")
    com.add_argument("--parametrization", choices=PARAMETRIZATIONS, default="balanced",
                     help="the converted layers' (convert_'s default: balanced)")
    com.add_argument("--gate-steps", type=int, default=40)
    com.add_argument("--gate-lr", type=float, default=1e-2)
    com.add_argument("--gate-headroom", type=float, default=1.25)
    com.add_argument("--tag", default="run")
    com.add_argument("--out", type=Path, default=OUT)
    com.set_defaults(run=cmd_compress)
    sta = sub.add_parser("starts", help="output error of each calibrated start, per format")
    _model_options(sta, pretrain=False)
    sta.add_argument("--formats", nargs="+", default=["tt", "ttm", "lowrank", "tucker"],
                     choices=CONVERTIBLE)
    sta.add_argument("--target", type=compression_target, default=2.0)
    sta.add_argument("--sweeps", type=int, default=2)
    sta.add_argument("--calib-rows", type=int, default=256)
    sta.add_argument("--out", type=Path, default=OUT)
    sta.set_defaults(run=cmd_starts)
    rep = sub.add_parser("report", help="merge every runs file into summary.md and the plot")
    rep.add_argument("--out", type=Path, default=OUT)
    rep.set_defaults(run=cmd_report)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
