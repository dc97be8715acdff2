"""The ``comera`` command: train the paper's models with rank-adaptive TT layers.

    comera train transformer --quick          # dense vs CoMERA on the stdlib pair task
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from comera.errors import ComeraError

EXIT_USAGE = 2
MODELS = ("transformer",)


def _cmd_train(args) -> int:
    from dataclasses import replace

    from comera.experiments.pair_task import PairTaskConfig, run, summary_table

    if args.model not in MODELS:
        raise ComeraError(f"model {args.model!r} is not available yet; choose one of "
                          f"{', '.join(MODELS)}.")
    cfg = PairTaskConfig() if args.quick else PairTaskConfig.full()
    changes = {"stage": args.stage}
    if args.target_compression is not None:
        if args.target_compression <= 1:
            raise ComeraError(f"--target-compression {args.target_compression}: it must be > 1.")
        changes["target_compression"] = args.target_compression
    if args.steps is not None:
        changes["steps_early"] = args.steps
    cfg = replace(cfg, **changes)

    def progress(name, stage, step, loss, acc):
        print(f"[{name:<6}] {stage:<5} step {step:>5}  loss {loss:.3f}  val acc {acc:.3f}",
              flush=True)

    summary = run(cfg, Path(args.out), progress)
    print()
    print(summary_table(summary))
    print(f"\nresults: {Path(args.out).resolve()}/pair_task.json and pair_task.md")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="comera", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a model dense and with CoMERA, side by side")
    p.add_argument("model", help=f"one of: {', '.join(MODELS)}")
    p.add_argument("--quick", action="store_true", help="a few minutes on 2 CPU cores")
    p.add_argument("--stage", choices=["early", "late", "both"], default="both")
    p.add_argument("--target-compression", type=float, default=None)
    p.add_argument("--steps", type=int, default=None, help="early-stage steps")
    p.add_argument("--out", default="runs/latest", help="output directory")
    p.set_defaults(run=_cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ComeraError as exc:
        print(f"comera: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
