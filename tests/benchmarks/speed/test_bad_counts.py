"""Every speed benchmark refuses a count option below 1 the same way, before it measures or
writes anything: one line naming the option, exit status 2
(:func:`benchmarks.lib.cli.check_at_least_one`)."""

from __future__ import annotations

import importlib

import pytest

from tests.benchmarks.speed.test_smoke import SCRIPTS

# each script's count options (bench_planning has none; bench_gpt_step's are tested with its
# other arguments in test_smoke.py)
COUNTS = {"bench_contract": ("threads",), "bench_dlrm": ("threads",),
          "bench_embedding": ("repeats", "threads"), "bench_formats": ("repeats",),
          "bench_growth": ("repeats", "threads"), "bench_plan_ops": ("repeats", "threads"),
          "bench_stack": ("repeats", "threads"),
          "bench_transformer": ("threads",), "bench_tt_linear": ("repeats",)}


def test_every_script_with_counts_is_listed():
    assert set(COUNTS) == set(SCRIPTS) - {"bench_planning", "bench_gpt_step"}


@pytest.mark.parametrize("script, option", [(s, o) for s, opts in sorted(COUNTS.items())
                                            for o in opts])
def test_a_count_below_one_is_refused_before_measuring(script, option, tmp_path, capsys):
    main = importlib.import_module(f"benchmarks.speed.{script}").main
    out = tmp_path / "result"
    with pytest.raises(SystemExit) as exc:
        main([f"--{option}", "0", "--out", str(out)])
    assert exc.value.code == 2
    assert f"--{option} 0; give at least 1" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written

