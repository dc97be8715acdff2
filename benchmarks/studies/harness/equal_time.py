"""The frontier at equal wall-clock: every model trains for the steps its measured step time buys
in dense's budget, and is scored at fractions of that budget.

The clock is an ``lm_clock`` results file (each model's median training step, measured side by
side in one process on a quiet machine). A model whose step takes ``ms`` trains ``steps x
dense_ms / ms`` steps (rounded down to a multiple of the evaluations), so every run costs dense's
wall-clock; with the constant schedule the run cut at a fraction of its steps is the run of that
smaller budget, so one run gives every budget its evaluations fall on. Rows gain ``budget``: the
clock's step time, peak memory and FLOPs of the model, and the validation loss at each fraction.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["FRACTIONS", "budget_entry", "clock_key", "steps_from_clock", "val_at"]

FRACTIONS = (0.25, 0.5, 1.0)  # the budgets the report reads, as fractions of dense's wall-clock


def clock_key(method: str, target: float | None) -> str:
    """The name ``benchmarks.studies.lm_clock`` gives a method's model: ``dense``, ``narrow
    8x``, ``tt 8x`` (a format's, whatever its parametrization); "" for an untargeted row."""
    base = method.partition(":")[0].partition(" ")[0]
    if base == "dense":
        return "dense"
    return "" if target is None else f"{base} {target:g}x"


def steps_from_clock(clock: dict, dense_steps: int,
                     evals: int) -> Callable[[str, float | None], int]:
    """(method, target) -> its steps at dense's wall-clock of ``dense_steps``: a multiple of
    ``evals``, at least ``evals``. A model the clock has no time for is a ValueError naming it."""
    times = clock["results"]
    dense_ms = times["dense"]["ms"]

    def steps(method: str, target: float | None) -> int:
        key = clock_key(method, target)
        if key not in times:
            raise ValueError(f"the clock has no step time for {method!r} at {target}x (it has "
                             f"{', '.join(times)}); measure it with python -m "
                             "benchmarks.studies.lm_clock --targets ...")
        n = dense_steps * dense_ms / times[key]["ms"]
        return max(evals, int(n) // evals * evals)

    return steps


def val_at(row: dict) -> list[list[float]]:
    """[fraction of the run's steps, validation loss] at each evaluation of ``row``'s curves."""
    steps = row["steps"]
    return [[round(step / steps, 6), scores["loss"]] for step, _, scores in row["curves"]["val"]]


def budget_entry(row: dict, clock: dict) -> dict:
    """What a row of the equal-time frontier adds: its model's clock entry (step ms, peak MiB,
    GFLOPs per step), its wall-clock and FLOPs at the clock's step time, and :func:`val_at`."""
    entry = clock["results"][clock_key(row["method"], row.get("target"))]
    return {"step_ms": entry["ms"], "peak_mib": entry.get("peak_mib"),
            "gflops_step": entry.get("gflops"), "seconds": row["steps"] * entry["ms"] / 1000,
            "val_at": val_at(row)}
