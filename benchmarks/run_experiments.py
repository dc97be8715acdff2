"""Run the paper's experiments (dense vs CoMERA, side by side) and keep their results.

    python benchmarks/run_experiments.py --quick                 # all three, a few minutes each
    python benchmarks/run_experiments.py dlrm mlm --quick
    python benchmarks/run_experiments.py transformer            # full mode: hours

Each experiment writes ``benchmarks/results/<task>_<mode>/``: ``<task>.json`` (every number,
curves included), ``<task>.md`` (the summary table) and the plots (training curves, rank
evolution per layer, compression vs score). Scores come from the validation split during
training and the test split at the end of each stage; nothing is tuned on the test split.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from comera.experiments.registry import EXPERIMENTS  # noqa: E402
from comera.experiments.results import run_experiment, summary_table  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tasks", nargs="*", default=list(EXPERIMENTS),
                        help=f"any of {', '.join(EXPERIMENTS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="the quick settings")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    mode = "quick" if args.quick else "full"
    for name in args.tasks:
        exp = EXPERIMENTS[name]
        start = time.perf_counter()
        task = exp.make_task(args.quick)
        summary = run_experiment(task, exp.engine(args.quick), args.out / f"{name}_{mode}")
        print(f"\n## {name} ({mode}, {time.perf_counter() - start:.0f} s)\n")
        print(summary_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
