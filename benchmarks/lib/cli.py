"""The speed benchmarks' shared command line: one ``--out``, one refusal of a count below 1,
and the header every results payload opens with (the machine and the run's mode)."""

from __future__ import annotations

import argparse
from typing import Any

from comera.experiments.results import machine

__all__ = ["OUT_HELP", "add_out", "check_at_least_one", "run_header", "run_mode"]

OUT_HELP = "results name under benchmarks/results/ or a path stem"


def add_out(parser: argparse.ArgumentParser, default: str | None, note: str = "") -> None:
    """Every benchmark's ``--out``: a results name under benchmarks/results/ or a path stem
    (:func:`benchmarks.lib.measure.write_results_to`); ``note`` says what a default of None
    picks."""
    parser.add_argument("--out", default=default,
                        help=OUT_HELP + (f" ({note})" if note else ""))


def check_at_least_one(parser: argparse.ArgumentParser, args: argparse.Namespace,
                       *names: str) -> None:
    """Refuse (``parser.error``: one line, exit 2, nothing written) each count option of
    ``names`` (``"repeats"``, ``"threads"``) given below 1; None is its default, left alone."""
    for name in names:
        value = getattr(args, name.replace("-", "_"))
        if value is not None and value < 1:
            parser.error(f"--{name} {value}; give at least 1")


def run_mode(args: argparse.Namespace) -> str:
    """The mode a benchmark ran in, as its results name it: "smoke" (``--smoke``), "quick"
    (``--quick``, where the script has it) or "full"."""
    return ("smoke" if getattr(args, "smoke", False)
            else "quick" if getattr(args, "quick", False) else "full")


def run_header(args: argparse.Namespace) -> dict[str, Any]:
    """What every benchmark's results open with: the machine (:func:`~comera.experiments.
    results.machine`: CPU, cores, threads, torch, commit, date) and :func:`run_mode`."""
    return {"machine": machine(), "mode": run_mode(args)}
