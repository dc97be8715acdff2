"""The ``comera`` command: train the paper's models, convert models, read checkpoints.

    comera train transformer --quick           # dense vs CoMERA, summary table and plots
    comera train dlrm --quick --nproc 2        # data-parallel over 2 processes (gloo)
    comera train mlm --quick --resume          # continue from the run's last checkpoint
    comera convert model.pt -o model_tt.pt --set ranks=16
    comera report runs/latest/checkpoints/comera.pt
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from comera.errors import ComeraError

EXIT_USAGE = 2
MODELS = ("transformer", "transformer-code", "dlrm", "mlm")
log = logging.getLogger("comera.cli")


# -- train ----------------------------------------------------------------------------------------
def _engine_config(args, exp) -> Any:
    cfg = exp.engine(args.quick)
    changes: dict[str, Any] = {"stage": args.stage, "device": args.device,
                               "on_nonfinite": args.on_nonfinite}
    for flag, field_name in (("target_compression", "target_compression"),
                             ("steps", "steps_early"), ("late_steps", "steps_late"),
                             ("batch_size", "batch_size"), ("checkpoint_every",
                                                            "checkpoint_every"),
                             ("seed", "seed"), ("eval_every", "eval_every"), ("lr", "lr"),
                             ("lam", "lam"), ("lr_gates", "lr_gates")):
        value = getattr(args, flag)
        if value is not None:
            changes[field_name] = value
    return replace(cfg, **changes)


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
                      f"  loss {event['loss']:.4f}  val {event['metric']} {event['value']:.4f}"
                      f"  compression {event['compression']:.1f}x  ranks {event['rank_total']}",
                      flush=True)
            return
        if name not in self.tasks:
            self.tasks[name] = self.progress.add_task(name, total=event["total"], name=name,
                                                      stage=event["stage"], info="")
        ev = self.last.get(name)
        info = f"loss {event['loss']:.4f}"
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
    from comera.experiments.registry import experiment
    from comera.experiments.results import run_experiment, summary_table

    if args.nproc < 1:
        raise ComeraError(f"--nproc {args.nproc}: the number of worker processes is >= 1.")
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _launch_workers(args, argv)
    if args.target_compression is not None and not args.target_compression > 1:
        raise ComeraError(f"--target-compression {args.target_compression}: it must be > 1 "
                          "(dense size / TT size), e.g. 50.")
    exp = experiment(args.model)
    config = _engine_config(args, exp)
    world = init_from_env(config.device)
    if config.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ComeraError(f"--device {config.device}: CUDA is not available here; use "
                              "--device cpu.")
    out = Path(args.out)
    variants = tuple(v for v in args.variants.split(",") if v)
    bad = [v for v in variants if v not in ("dense", "comera")]
    if bad or not variants:
        raise ComeraError(f"--variants {args.variants!r}: choose from dense,comera.")
    if args.init_from and not exp.init_from:
        raise ComeraError(f"--init-from: the {exp.name} experiment cannot start from a "
                          "checkpoint; it works for transformer and transformer-code.")
    task = (exp.make_task(args.quick, init_from=args.init_from) if args.init_from
            else exp.make_task(args.quick))
    show = world.is_main and not args.no_progress and sys.stdout.isatty() \
        and not os.environ.get("COMERA_NO_PROGRESS")
    with _Bars(show) as bars:
        summary = run_experiment(task, config, out, variants, args.resume,
                                 bars if world.is_main else None)
    if world.is_main:
        print()
        print(summary_table(summary))
        print(f"\nresults: {out.resolve()}/{task.name}.json, {task.name}.md and "
              f"{task.name}_*.png; checkpoints in {out.resolve()}/checkpoints/")
    return 0


# -- convert / report -----------------------------------------------------------------------------
def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _convert_config(args):
    from comera.convert import ConvertConfig

    fields: dict[str, Any] = {}
    if args.config:
        source = Path(args.config)
        try:
            fields.update(json.loads(source.read_text()) if source.is_file()
                          else json.loads(args.config))
        except json.JSONDecodeError as exc:
            raise ComeraError(
                f"--config {args.config!r} is neither a JSON file nor JSON text ({exc.msg} at "
                f"{exc.pos}); e.g. --config '{{\"ranks\": 16}}'.") from None
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ComeraError(f"--set {item!r}: expected KEY=VALUE, e.g. --set ranks=16.")
        fields[key.strip()] = _parse_value(value)
    known = set(ConvertConfig.__dataclass_fields__)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ComeraError(f"unknown convert setting(s) {', '.join(unknown)}; known: "
                          f"{', '.join(sorted(known))}.")
    for key in ("include", "exclude"):
        if isinstance(fields.get(key), str):
            fields[key] = (fields[key],)
    return ConvertConfig(**fields)


def _cmd_convert(args, argv) -> int:
    import torch
    from torch import nn

    import comera

    source = Path(args.model)
    if not source.is_file():
        raise ComeraError(f"model file {source} does not exist; save one with "
                          "torch.save(model, 'model.pt').")
    config = _convert_config(args)
    try:  # a whole pickled module: only load files you trust
        model = torch.load(source, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise ComeraError(f"{source} could not be loaded as a torch model ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160]}); save it with torch.save(model, "
                          "path), with the model's classes importable.") from exc
    if not isinstance(model, nn.Module):
        raise ComeraError(f"{source} holds a {type(model).__name__}, not an nn.Module; a "
                          "state_dict cannot be converted without its model: save the module "
                          "itself with torch.save(model, path).")
    report = comera.convert_(model, config)
    print(report)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    comera.save_checkpoint(out, model, converted_from=str(source))
    print(f"\nwrote {out} (load it into the original architecture with "
          "comera.load_checkpoint(path, model))")
    return 0


def _cmd_report(args, argv) -> int:
    from comera.report import checkpoint_report

    print(checkpoint_report(args.checkpoint))
    return 0


# -- parser ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="comera", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model dense and with CoMERA, side by side")
    p.add_argument("model", help=f"one of: {', '.join(MODELS)}")
    p.add_argument("--quick", action="store_true", help="a few minutes on 2 CPU cores")
    p.add_argument("--stage", choices=["early", "late", "both"], default="both")
    p.add_argument("--target-compression", type=float, default=None,
                   help="late stage: TT layers' dense size / TT size to reach")
    p.add_argument("--steps", type=int, default=None, help="early-stage steps")
    p.add_argument("--late-steps", type=int, default=None, help="late-stage steps")
    p.add_argument("--batch-size", type=int, default=None, help="global batch size")
    p.add_argument("--lr", type=float, default=None, help="learning rate of cores / dense model")
    p.add_argument("--lam", type=float, default=None, help="early stage: rank-regulariser weight")
    p.add_argument("--lr-gates", type=float, default=None, help="learning rate of the rank gates")
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--out", default="runs/latest", help="output directory")
    p.add_argument("--variants", default="dense,comera", help="which models: dense,comera")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoints in --out")
    p.add_argument("--checkpoint-every", type=int, default=None, help="steps between checkpoints")
    p.add_argument("--on-nonfinite", choices=["stop", "skip"], default="stop",
                   help="a NaN/inf loss or gradient: stop (keep the last checkpoint) or skip")
    p.add_argument("--init-from", default=None, metavar="CKPT",
                   help="start the classifier's encoder from a `comera train mlm` checkpoint "
                        "(transformer, transformer-code)")
    p.add_argument("--nproc", type=int, default=1, help="data-parallel worker processes")
    p.add_argument("--no-progress", action="store_true", help="plain log lines, no bars")
    p.set_defaults(run=_cmd_train)

    p = sub.add_parser("convert", help="replace a saved model's linear/embedding layers by TT")
    p.add_argument("model", help="a file written by torch.save(model, path)")
    p.add_argument("-o", "--output", required=True, help="the comera checkpoint to write")
    p.add_argument("--config", help="ConvertConfig as a JSON file or JSON text")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="one ConvertConfig field, e.g. ranks=16 or target_compression=20")
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
        print(f"comera: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("comera: interrupted (resume with --resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
