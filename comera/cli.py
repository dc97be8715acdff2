"""The ``comera`` command: train the paper's models, convert models, read checkpoints.

    comera train transformer --quick           # dense vs CoMERA, summary table and plots
    comera train dlrm --quick --nproc 2        # data-parallel over 2 processes (gloo)
    comera train dlrm --quick --format tucker  # the CoMERA run's layers in another format
    comera train lm --quick                    # TT-matrix layers: the task's recommended format
    comera train mlm --quick --resume          # continue from the run's last checkpoint
    comera convert model.pt -o model_tt.pt --set ranks=16
    comera report runs/latest/checkpoints/comera.pt
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import typing
import warnings
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from comera.errors import ComeraError, ConfigError
from comera.torchfile import NotATorchFileError, check_torch_file, peek_torch_file

EXIT_USAGE = 2
MAX_NPROC = 1024
log = logging.getLogger("comera.cli")


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _one_line(text: str) -> str:
    """An error message as the promised single line: colour codes dropped (torch's messages
    carry some), newlines and runs of blanks folded into one space."""
    return " ".join(_ANSI.sub("", text).split())


# -- train ----------------------------------------------------------------------------------------
# EngineConfig field -> the `comera train` option that sets it
FLAGS = {"target_compression": "--target-compression", "steps_early": "--steps",
         "steps_late": "--late-steps", "batch_size": "--batch-size",
         "checkpoint_every": "--checkpoint-every", "seed": "--seed", "eval_every": "--eval-every",
         "lr": "--lr", "lam": "--lam", "lr_gates": "--lr-gates", "threads": "--threads",
         "late_allocation": "--late-allocation", "late_landing": "--late-landing"}
# EngineConfig field -> the option that sets it, for the options that always give a value
SET_ALWAYS = {"device": "--device", "format": "--format"}
# `comera train --format`'s default, the CoMERA run's format when none is named: each task's
# recommended_format (tests/comera/test_cli_formats.py keeps this true to the tasks)
RECOMMENDED = "ttm for lm and mlm, tt for dlrm, transformer and transformer-code"


def _engine_config(args, exp, format: str | None = None) -> Any:
    """The experiment's quick or full settings with the options given; ``format`` the CoMERA
    run's (None: ``--format``, else the experiment's until the task, once built, names its
    recommended one)."""
    cfg = exp.engine(args.quick)
    changes: dict[str, Any] = {"stage": args.stage, "device": args.device,
                               "on_nonfinite": args.on_nonfinite,
                               "precision": args.precision, "compile": args.compile,
                               "memory": args.memory,
                               "checkpoint_blocks": args.checkpoint_blocks, "fsdp": args.fsdp,
                               "format": format or args.format or cfg.format}
    for field_name, flag in FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            changes[field_name] = value
    try:
        return replace(cfg, **changes)
    except ConfigError as exc:
        raise _with_flags(exc) from None


def _given_format(args, out: Path, variants: tuple[str, ...]) -> str | None:
    """The CoMERA run's format as the command names it: ``--format``, else, resuming, the
    format its checkpoint in ``out`` was trained in (a run started under another default
    continues as it began); None leaves it to the task (:attr:`Task.recommended_format`)."""
    if args.format is not None:
        return args.format
    saved = out / "checkpoints" / "comera.pt"
    if args.resume and "comera" in variants and saved.is_file():
        from comera.experiments.engine import run_checkpoint_format

        return run_checkpoint_format(saved)
    return None


def _with_format(config: Any, format: str) -> Any:
    """``config`` with the CoMERA run's ``format``, its settings checked against it."""
    try:
        return replace(config, format=format)
    except ConfigError as exc:
        raise _with_flags(exc) from None


def _with_flags(exc: ConfigError) -> ConfigError:
    """The engine names its settings; say which option sets each one it names."""
    text = str(exc)
    named = [f"{flag} sets {name}" for name, flag in {**FLAGS, **SET_ALWAYS}.items()
             if re.search(rf"\b{name}=", text)]
    return ConfigError(f"{text} ({'; '.join(named)})" if named else text)


def _loss_text(event: dict) -> str:
    """"  loss 0.1234", or nothing before the first training step (there is no loss yet)."""
    loss = event.get("loss")
    return "" if loss is None or loss != loss else f"  loss {loss:.4f}"


class _Bars:
    """rich progress bars, one per model: step, stage, loss, validation score, compression."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.progress = None
        self.tasks: dict[str, Any] = {}
        self.last: dict[str, dict] = {}

    def __enter__(self):
        if self.enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.progress = Progress(
                TextColumn("[bold]{task.fields[name]:<7}"), TextColumn("{task.fields[stage]:<5}"),
                BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"))
            self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.__exit__(*exc)

    def __call__(self, event: dict) -> None:
        name = event["name"]
        if event["kind"] == "eval":
            self.last[name] = event
        if self.progress is None:
            if event["kind"] == "eval":
                print(f"[{name:<6}] {event['stage']:<5} step {event['step']:>6}/{event['total']}"
                      f"{_loss_text(event)}  val {event['metric']} {event['value']:.4f}"
                      f"  compression {event['compression']:.1f}x  ranks {event['rank_total']}",
                      flush=True)
            return
        if name not in self.tasks:
            self.tasks[name] = self.progress.add_task(name, total=event["total"], name=name,
                                                      stage=event["stage"], info="")
        ev = self.last.get(name)
        info = _loss_text(event).strip()
        if ev:
            info += (f"  val {ev['metric']} {ev['value']:.4f}  "
                     f"x{event.get('compression', ev['compression']):.1f}  "
                     f"ranks {ev['rank_total']}")
        self.progress.update(self.tasks[name], completed=event["step"], stage=event["stage"],
                             info=info)


def _launch_workers(args, argv: list[str]) -> int:
    """Re-run this command under torchrun with ``--nproc`` workers."""
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        rest.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc}", "-m", "comera.cli", *rest]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nproc))}
    log.info("launching %s", " ".join(cmd))
    return subprocess.call(cmd, env=env)


def _cmd_train(args, argv: list[str]) -> int:
    from comera.experiments.distributed import init_from_env
    from comera.experiments.registry import EXPERIMENTS, experiment
    from comera.experiments.results import check_experiment, run_experiment, summary_table

    if not 1 <= args.nproc <= MAX_NPROC:
        raise ComeraError(f"--nproc {args.nproc}: the number of worker processes is between 1 "
                          f"and {MAX_NPROC}, e.g. --nproc 2.")
    exp = experiment(args.model)
    if not args.out.strip():
        raise ComeraError("--out '': give the run directory, e.g. --out runs/latest.")
    out = Path(args.out)
    variants = tuple(v for v in args.variants.split(",") if v)
    if (not variants or any(v not in ("dense", "comera") for v in variants)
            or len(set(variants)) != len(variants)):
        raise ComeraError(f"--variants {args.variants!r}: choose from dense,comera, each once.")
    format = _given_format(args, out, variants)
    config = _engine_config(args, exp, format)
    if args.init_from is not None and not exp.init_from:
        raise ComeraError(f"--init-from: the {exp.name} experiment cannot start from a "
                          "checkpoint; it works for transformer and transformer-code.")
    if args.init_from is not None and not Path(args.init_from).is_file():
        raise ComeraError(f"--init-from {args.init_from!r} is not a file; give a checkpoint of "
                          "`comera train mlm`, e.g. runs/mlm/checkpoints/comera.pt.")
    if args.init_from is not None:
        try:
            check_torch_file(args.init_from)
        except (NotATorchFileError, OSError) as exc:
            raise ComeraError(f"--init-from {args.init_from}: {exc}; give a checkpoint of "
                              "`comera train mlm`, e.g. runs/mlm/checkpoints/comera.pt.") from None
    if args.parametrization is not None and not exp.parametrization:
        able = ", ".join(name for name, e in EXPERIMENTS.items() if e.parametrization)
        raise ComeraError(f"--parametrization: the {exp.name} task sets no parametrization of "
                          f"its layers; it works for {able}.")
    if args.checkpoint_blocks and not exp.checkpoint_blocks:
        able = ", ".join(name for name, e in EXPERIMENTS.items() if e.checkpoint_blocks)
        raise ComeraError(f"--checkpoint-blocks: the {exp.name} model has no encoder blocks to "
                          f"checkpoint; it works for {able}.")
    if "WORLD_SIZE" not in os.environ:  # not a launched worker: check before launching any
        try:
            check_experiment(config, out, variants, args.resume, args.nproc)
        except ConfigError as exc:
            raise _with_flags(exc) from None
        if args.nproc > 1:
            return _launch_workers(args, argv)
    world = init_from_env(config.device)
    if args.init_from:
        task = exp.make_task(args.quick, init_from=args.init_from)
    elif args.parametrization is not None:
        task = exp.make_task(args.quick, parametrization=args.parametrization)
    else:
        task = exp.make_task(args.quick)
    if format is None:  # the task's own choice (an --init-from encoder's format, for one)
        config = _with_format(config, task.recommended_format)
    show = world.is_main and not args.no_progress and sys.stdout.isatty() \
        and not os.environ.get("COMERA_NO_PROGRESS")
    with _Bars(show) as bars:
        try:
            summary = run_experiment(task, config, out, variants, args.resume,
                                     bars if world.is_main else None)
        except ConfigError as exc:  # e.g. a target the task's model cannot reach
            raise _with_flags(exc) from None
    if world.is_main:
        print()
        print(summary_table(summary))
        print(f"\nresults: {out.resolve()}/{task.name}.json, {task.name}.md and "
              f"{task.name}_*.png; checkpoints in {out.resolve()}/checkpoints/")
    return 0


# -- convert / report -----------------------------------------------------------------------------
MAX_JSON_DEPTH = 16  # a ConvertConfig nests 4 levels (modes: name -> sides -> modes)


def _json_problem(value: Any) -> str | None:
    """What makes a parsed JSON value unfit for a setting (None when nothing): nesting past
    :data:`MAX_JSON_DEPTH`, or a whole number too large for a float. Walked without recursion,
    so any depth is answered."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return (f"it nests more than {MAX_JSON_DEPTH} levels deep; a convert setting is a "
                    "number, a string, or a short list or object of them")
        if isinstance(item, int) and not isinstance(item, bool):
            try:
                float(item)
            except OverflowError:
                return (f"it holds a whole number of {len(str(abs(item)))} digits, too large "
                        "for a float (at most about 1.8e308)")
        elif isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return None


def _load_json(text: str) -> Any:
    """``json.loads(text)``, with the errors it raises past malformed text (nesting too deep
    for the parser, a number of more digits than Python converts) as a ``ValueError`` naming
    the cause; the value is checked by :func:`_json_problem`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise ValueError(f"it nests more than {MAX_JSON_DEPTH} levels deep (too deep to "
                         "parse); a convert setting is a number, a string, or a short list "
                         "or object of them") from None
    except ValueError as exc:  # e.g. Python's limit on the digits of an int it converts
        raise ValueError(f"it holds a number too long to read ({exc}); a float holds at most "
                         "about 1.8e308") from None
    problem = _json_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def _parse_value(text: str, item: str) -> Any:
    """A ``--set`` value: JSON when it parses as JSON, else the text itself (a name)."""
    try:
        return _load_json(text)
    except json.JSONDecodeError:
        return text
    except ValueError as exc:
        shown = item if len(item) <= 40 else item[:37] + "..."
        raise ComeraError(f"--set {shown!r}: {exc}; e.g. --set target_compression=20.") \
            from None


def _convert_config(args):
    """The ConvertConfig of ``--config`` (a JSON file or JSON text) and ``--set KEY=VALUE``
    pairs (the later wins), checked by :func:`~comera.surgery.config.config_from_json`."""
    from comera.surgery.config import config_from_json

    fields: dict[str, Any] = {}
    if args.config is not None:
        source = Path(args.config)
        shown = args.config if len(args.config) <= 60 else args.config[:57] + "..."
        try:
            is_file = bool(args.config) and source.is_file()
        except OSError:  # e.g. JSON text longer than a file name may be
            is_file = False
        try:
            given = _load_json(source.read_text()) if is_file else _load_json(args.config)
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
            why = (f"{exc.msg} at {exc.pos}" if isinstance(exc, json.JSONDecodeError)
                   else f"{type(exc).__name__}: {getattr(exc, 'strerror', None) or exc}")
            raise ComeraError(
                f"--config {shown!r} is neither a JSON file nor JSON text ({why}); "
                "e.g. --config '{\"ranks\": 16}'.") from None
        except ValueError as exc:  # parsed, but not a value a setting takes
            raise ComeraError(f"--config {shown!r}: {exc}; e.g. --config "
                              "'{\"ranks\": 16}'.") from None
        if not isinstance(given, dict):
            raise ComeraError(f"--config {shown!r} is not a JSON object; e.g. --config "
                              "'{\"ranks\": 16}'.")
        fields.update(given)
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ComeraError(f"--set {item[:40]!r}: expected KEY=VALUE, e.g. --set ranks=16.")
        fields[key.strip()] = _parse_value(value, item)
    return config_from_json(fields)


def _not_a_model(source: Path, data: Any) -> str:
    """Why a file of plain data (read without running code) cannot be converted."""
    from torch import Tensor

    if isinstance(data, dict) and data.get("format") == "comera-checkpoint":
        return (f"{source} is a comera checkpoint, not an nn.Module: it is converted already "
                f"(see it with `comera report {source}`; load it with "
                "comera.load_checkpoint(path, model)).")
    if isinstance(data, Mapping) and data and all(isinstance(v, Tensor) for v in data.values()):
        what = f"a state dict ({len(data)} tensors)"
    elif isinstance(data, Tensor):
        what = f"a tensor of shape {tuple(data.shape)}"
    else:
        what = f"a {type(data).__name__}"
    return (f"{source} holds {what}, not an nn.Module; a state_dict or a tensor cannot be "
            "converted without its model: save the module itself with torch.save(model, path).")


def _check_output(path: Path, flag: str, source: Path, force: bool) -> None:
    """A file a command writes: its folder must exist (nothing creates folders silently), it
    is not the input ``source``, and an existing file is replaced only with ``--force``."""
    if not str(path).strip() or str(path) == ".":
        raise ComeraError(f"{flag} {str(path)!r}: give a file name, e.g. {flag} model_tt.pt.")
    if path.is_dir():
        raise ComeraError(f"{flag} {path} is a directory; give a file name, e.g. "
                          f"{path / 'model_tt.pt'}.")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ComeraError(f"{flag} {path}: the folder {folder} does not exist; create it first "
                          f"(mkdir -p {folder}).")
    if path.exists() and (path.resolve() == source.resolve() or os.path.samefile(path, source)):
        raise ComeraError(f"{flag} {path} is the model file being converted; writing there "
                          "would replace it: give another name, e.g. "
                          f"{path.with_name(path.stem + '_tt.pt')}.")
    if path.exists() and not force:
        raise ComeraError(f"{flag} {path} exists; pass --force to replace it, or give another "
                          "name.")


def _calibration_batches(path: str | None, flag: str = "--calibration") -> list | None:
    """The batches of ``--calibration`` (or ``flag``): a torch file (read without running code)
    holding a list or tuple of batches, or one batch (a tensor or a dict of keyword
    arguments)."""
    from torch import Tensor

    if path is None:
        return None
    source = Path(path)
    if not source.is_file():
        raise ComeraError(f"{flag} {source}: no such file; save a list of input batches "
                          "with torch.save([x1, x2, ...], path).")
    kind, data = peek_torch_file(source)
    if kind != "data":
        why = (data if kind == "unreadable" else f"it pickles {data}, which is not unpickled: "
               "loading it could run arbitrary code")
        raise ComeraError(f"{flag} {source} is not a torch file of tensors ({why}); "
                          "save a list of input batches with torch.save([x1, x2, ...], path).")
    batches = [data] if isinstance(data, Tensor | Mapping) else data
    if not isinstance(batches, list | tuple) or not batches:
        what = "no batches" if isinstance(batches, list | tuple) else type(data).__name__
        raise ComeraError(f"{flag} {source} holds {what}; save a non-empty list of input "
                          "batches (tensors, or dicts of keyword arguments) with "
                          "torch.save([x1, x2, ...], path).")
    return list(batches)


def _cmd_convert(args, argv) -> int:
    import torch
    from torch import nn

    import comera
    from comera.data.progress import progress_bar
    from comera.surgery.convert import HF_SAVE_WARNING

    if not args.model.strip():
        raise ComeraError("model file '': give the file of torch.save(model, path), e.g. "
                          "comera convert model.pt -o model_tt.pt.")
    source = Path(args.model)
    if not source.is_file():
        raise ComeraError(f"model file {source} does not exist; save one with "
                          "torch.save(model, 'model.pt').")
    out = Path(args.output)
    _check_output(out, "-o", source, args.force)
    config = _convert_config(args)
    batches = _calibration_batches(args.calibration)
    measure = _calibration_batches(args.measure, "--measure")
    if measure is not None and config.floor != "measured":
        raise ComeraError("--measure is read by the measured floor only; add --set "
                          "allocation=sensitivity (or --set allocation=global --set "
                          "floor=measured), or drop --measure.")
    kind, what = peek_torch_file(source)
    if kind == "unreadable":
        raise ComeraError(f"{source} is not a torch file ({what}); save the model with "
                          "torch.save(model, path).")
    if kind == "data":
        raise ComeraError(_not_a_model(source, what))
    try:  # a whole pickled module: this runs code from the file, so only convert trusted files
        model = torch.load(source, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise ComeraError(f"{source} could not be loaded as a torch model ({type(exc).__name__}: "
                          f"{_one_line(str(exc))[:160]}); save it with torch.save(model, path), "
                          "with the model's classes importable.") from exc
    if not isinstance(model, nn.Module):
        raise ComeraError(f"{source} holds a {type(model).__name__}, not an nn.Module; save the "
                          "module itself with torch.save(model, path).")
    with warnings.catch_warnings(record=True) as said:  # shown once the conversion is kept
        warnings.simplefilter("always")
        try:
            if batches is None:
                report = comera.convert_(model, config)
            else:
                with progress_bar("calibration", len(batches)) as advance:
                    report = comera.convert_(model, config, calibration=batches,
                                             progress=lambda _done: advance(1),
                                             measure=measure)
        except ComeraError as exc:  # convert_ refuses before any swap: nothing is written
            raise type(exc)(f"{str(exc).rstrip('.')}; nothing was written.") from None
    _check_reached(report, config.target_compression)
    print(report)
    for warning in said:
        if str(warning.message) == HF_SAVE_WARNING:
            continue  # about HF's save_pretrained folders: this writes a comera checkpoint
        print(f"comera: warning: {_one_line(str(warning.message))}", file=sys.stderr)
    comera.save_checkpoint(out, model, converted_from=str(source))
    print(f"\nwrote {out} (load it into the original architecture with "
          "comera.load_checkpoint(path, model): a model built as the original was, dense "
          "or converted)")
    return 0


def _check_reached(report: Any, target: float | None) -> None:
    """Refuse (nothing written) a conversion whose layers compress less than the
    ``target_compression`` asked for: some are out of its reach even at rank 1."""
    reached = report.before / max(report.after, 1)
    if target is None or reached >= target:
        return
    short = [f"{r.name} ({r.before / max(r.after, 1):.2f}x)" for r in report.layers
             if r.before / max(r.after, 1) < target]
    raise ComeraError(f"target_compression={target:g} cannot be reached: the converted layers "
                      f"compress {reached:.2f}x, at rank 1 where {', '.join(short[:6])}"
                      f"{' ...' if len(short) > 6 else ''} fall short; nothing was written. "
                      "Lower the target, or give those layers other modes (--set modes=...) or "
                      "leave them dense (--set exclude=...).")


def _cmd_report(args, argv) -> int:
    from comera.errors import CheckpointError
    from comera.surgery.report import checkpoint_report

    path = Path(args.checkpoint)
    try:
        report = checkpoint_report(path)
    except CheckpointError:
        kind, what = peek_torch_file(path) if path.is_file() else ("", None)
        if kind == "object":
            raise ComeraError(
                f"{path} is a pickled Python object ({what}), e.g. a whole model saved with "
                f"torch.save(model, path), not a comera checkpoint: convert it first with "
                f"`comera convert {path} -o {path.with_name(path.stem + '_tt.pt')}`.") from None
        raise
    print(report)
    return 0


# -- parser ---------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as the promised single line (and exit 2)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {_one_line(message)}; see {self.prog} "
                              "--help.\n")


def build_parser() -> argparse.ArgumentParser:
    from comera.experiments.engine_config import LATE_ALLOCATIONS
    from comera.experiments.registry import EXPERIMENTS  # the one list of models
    from comera.formats.registry import DENSE, layer_formats  # the one list of formats
    from comera.formats.scaling import PARAMETRIZATIONS

    parser = _Parser(prog="comera", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("train", help="train a model dense and with CoMERA, side by side")
    p.add_argument("model", help=f"one of: {', '.join(EXPERIMENTS)}")
    p.add_argument("--quick", action="store_true", help="a few minutes on 2 CPU cores")
    p.add_argument("--stage", choices=["early", "late", "both"], default="both")
    p.add_argument("--format", choices=[f for f in layer_formats() if f != DENSE], default=None,
                   help="the CoMERA run's layer kind, a registered format (its tables in the "
                        "format's table format: tt's are ttm); the dense run stays dense "
                        f"(default: the task's recommended format, {RECOMMENDED}; with "
                        "--resume, the run's own; with --init-from, the checkpoint's)")
    p.add_argument("--target-compression", type=float, default=None,
                   help="late stage: gated layers' dense size / compressed size to reach")
    p.add_argument("--steps", type=int, default=None, help="early-stage steps (>= 1)")
    p.add_argument("--late-steps", type=int, default=None, help="late-stage steps")
    p.add_argument("--late-allocation", choices=list(LATE_ALLOCATIONS), default=None,
                   help="late stage: fix the final shape from the bonds' spectra when it starts "
                        "(spectrum: tt, ttm), or prune along its steps (prune: any format); "
                        "default auto: spectrum for balanced cores on chains, else prune")
    p.add_argument("--parametrization", choices=list(PARAMETRIZATIONS), default=None,
                   help="how the gated layers scale their cores (lm, mlm; default balanced; "
                        "plain: the cores of before 0.2.0)")
    p.add_argument("--late-landing", type=float, default=None,
                   help="late stage, pruning: the fraction of its steps after which it is on "
                        "the target (default 0.75)")
    p.add_argument("--batch-size", type=int, default=None, help="global batch size")
    p.add_argument("--lr", type=float, default=None, help="learning rate of cores / dense model")
    p.add_argument("--lam", type=float, default=None, help="early stage: rank-regulariser weight")
    p.add_argument("--lr-gates", type=float, default=None, help="learning rate of the rank gates")
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: the faster of 1 and all, timed at the start)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (one this machine has)")
    p.add_argument("--out", default="runs/latest",
                   help="run directory (created if missing; one run at a time)")
    p.add_argument("--variants", default="dense,comera", help="which models: dense,comera")
    p.add_argument("--resume", action="store_true",
                   help="continue from the checkpoints in --out (an error if there are none)")
    p.add_argument("--checkpoint-every", type=int, default=None, help="steps between checkpoints")
    p.add_argument("--on-nonfinite", choices=["stop", "skip"], default="stop",
                   help="a NaN/inf loss or gradient: stop (keep the last checkpoint) or skip")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="forward under torch.autocast: bf16, or fp16 (CUDA, with a GradScaler)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model's forward")
    p.add_argument("--memory", choices=["fast", "balanced", "min"], default="fast",
                   help="what TT layers keep for the backward: every intermediate (fast), "
                        "the costly-to-recompute ones (balanced), none: recompute (min)")
    p.add_argument("--checkpoint-blocks", action="store_true",
                   help="recompute each encoder block's activations in the backward: less "
                        "memory, about one more forward of time (transformer models only)")
    p.add_argument("--init-from", default=None, metavar="CKPT",
                   help="start the classifier's encoder from a `comera train mlm` checkpoint "
                        "(transformer, transformer-code)")
    p.add_argument("--nproc", type=int, default=1, help="data-parallel worker processes")
    p.add_argument("--fsdp", action="store_true",
                   help="with --nproc N: FSDP2, dense parts sharded, TT layers replicated")
    p.add_argument("--no-progress", action="store_true", help="plain log lines, no bars")
    p.set_defaults(run=_cmd_train)

    p = sub.add_parser(
        "convert", help="replace a saved model's linear/embedding layers by gated layers of "
        "any format (TT by default)",
        description="Convert a whole model saved with torch.save(model, path) and write a comera "
        "checkpoint. The input must be a file you trust: loading a pickled model runs code from "
        "the file. Files of plain data (a state dict, a checkpoint, a tensor) are refused before "
        "anything is unpickled.")
    p.add_argument("model", help="a file written by torch.save(model, path); it is unpickled, so "
                   "only give files you trust")
    p.add_argument("-o", "--output", required=True,
                   help="the comera checkpoint to write (its folder must exist)")
    p.add_argument("--config", help="ConvertConfig as a JSON file or JSON text")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="one ConvertConfig field, e.g. ranks=16, format=ttm or "
                   "target_compression=20")
    p.add_argument("--force", action="store_true", help="replace the -o file if it exists")
    p.add_argument("--calibration", metavar="BATCHES",
                   help="a torch file of input batches (a list of tensors, or of dicts of "
                   "keyword arguments): linear layers are decomposed to minimise the error of "
                   "their outputs on these inputs")
    p.add_argument("--measure", metavar="BATCHES",
                   help="with --set allocation=sensitivity, or --set allocation=global --set "
                   "floor=measured: a torch file of batches (held out) on which the model's "
                   "loss (its output's .loss, e.g. a HuggingFace model given labels) measures "
                   "each layer's sensitivity and decides between those ranks and the uniform "
                   "ones; default: the calibration batches")
    p.set_defaults(run=_cmd_convert)

    p = sub.add_parser("report", help="per-layer ranks, sizes and compression of a checkpoint")
    p.add_argument("checkpoint")
    p.set_defaults(run=_cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args, argv)
    except ComeraError as exc:
        print(f"comera: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("comera: interrupted (resume with --resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
