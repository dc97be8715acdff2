"""The speed benchmarks' shared command line: ``--out``, the count check, the results header
(every script's refusals: tests/benchmarks/speed/test_bad_counts.py)."""

from __future__ import annotations

import argparse

from benchmarks.lib.cli import add_out, check_at_least_one, run_header, run_mode


def test_check_at_least_one_leaves_defaults_alone():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--max-rows", type=int, default=5)
    add_out(parser, None, "default x_cpu")
    args = parser.parse_args([])
    check_at_least_one(parser, args, "repeats", "max-rows")  # None and 5: both fine
    assert args.out is None
    assert "path stem (default x_cpu)" in " ".join(parser.format_help().split())


def test_run_header_names_the_machine_and_the_mode():
    assert run_mode(argparse.Namespace(smoke=True, quick=True)) == "smoke"
    assert run_mode(argparse.Namespace(smoke=False, quick=True)) == "quick"
    assert run_mode(argparse.Namespace(smoke=False)) == "full"  # a script without --quick
    header = run_header(argparse.Namespace(smoke=False, quick=False))
    assert header["mode"] == "full" and {"cpu", "torch", "commit"} <= set(header["machine"])
