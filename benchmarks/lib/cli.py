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


def add_gpt_options(parser: argparse.ArgumentParser, *, widths: str, repeats: str, smoke: str,
                    note: str) -> None:
    """The options of the scripts that time the small GPT at several widths: ``--d-model``,
    ``--repeats``, ``--threads``, ``--smoke`` and ``--note``, each with its script's help."""
    parser.add_argument("--d-model", type=int, nargs="+", default=None, help=widths)
    parser.add_argument("--repeats", type=int, default=None, help=repeats)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help=smoke)
    parser.add_argument("--note", default=note,
                        help="what the machine was doing (written with the results)")


def check_gpt_options(parser: argparse.ArgumentParser, args: argparse.Namespace,
                      heads: int) -> None:
    """Refuse, before any work, a count below 1 and a width the GPT's ``heads`` do not divide
    (or below two per head)."""
    check_at_least_one(parser, args, "repeats", "threads")
    if args.d_model is not None and any(d < 2 * heads or d % heads for d in args.d_model):
        parser.error(f"--d-model {args.d_model}; each width is a multiple of {heads} heads, "
                     f"at least {2 * heads}")
