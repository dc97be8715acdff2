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

import itertools
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from benchmarks.studies.harness.results import at_best_lr, by_method, mean_sd

__all__ = ["FRACTIONS", "Unigram", "at_budget", "budget_entry", "clock_key", "plot",
           "steps_from_clock", "summarise", "unigram_scores", "val_at"]

FRACTIONS = (0.25, 0.5, 1.0)  # the budgets the report reads, as fractions of dense's wall-clock


def clock_key(method: str, target: float | None) -> str:
    """The name ``benchmarks.studies.lm_clock`` gives a method's model: ``dense``, ``dense@96``
    (dense at that d_model, ``--widths``), ``narrow 8x``, ``tt 8x`` (a format's, whatever its
    parametrization); "" for any other untargeted row."""
    base = method.partition(":")[0].partition(" ")[0]
    if base == "dense" or base.startswith("dense@"):
        return base
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
            how = (f"--widths {key.partition('@')[2]}" if key.startswith("dense@")
                   else "--targets ...")
            raise ValueError(f"the clock has no step time for {method!r} at {target}x (it has "
                             f"{', '.join(times)}); measure it with python -m "
                             f"benchmarks.studies.lm_clock {how}")
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


# -- the baseline a model must beat -----------------------------------------------------------
class Unigram(nn.Module):
    """Every position predicts the training tokens' frequencies (add-one smoothed): the language
    model's majority-class baseline, scored by the task's own evaluation."""

    def __init__(self, log_probs: Tensor):
        super().__init__()
        self.log_probs = nn.Parameter(log_probs, requires_grad=False)

    def forward(self, ids: Tensor) -> Tensor:
        return self.log_probs.expand(*ids.shape, -1)


def unigram_scores(task) -> dict[str, float]:
    """The validation and test loss of :class:`Unigram` on ``task`` (an LM task: ``train.ids``,
    ``next_token_targets``' ignore rule, ``evaluate``)."""
    from comera.experiments.lm_task import next_token_targets

    targets = next_token_targets(task.train.ids)[1]
    counts = torch.bincount(targets[targets >= 0], minlength=task.vocab).double() + 1
    model = Unigram((counts / counts.sum()).log().float())
    return {split: task.evaluate(model, split)["loss"] for split in ("val", "test")}


# -- the report ---------------------------------------------------------------------------------
def _loss_at(row: dict, fraction: float) -> float:
    return next(loss for f, loss in row["budget"]["val_at"] if abs(f - fraction) < 1e-6)


def _has(row: dict, fraction: float) -> bool:
    return any(abs(f - fraction) < 1e-6 for f, _ in row["budget"]["val_at"])


def at_budget(rows: list[dict], fraction: float) -> dict[tuple, tuple[list[dict], str]]:
    """Per (target, method): its rows at the learning rate whose mean validation loss at
    ``fraction`` of the budget is best, and how that rate was chosen."""
    return {key: at_best_lr(group, lambda r: _loss_at(r, fraction))
            for key, group in by_method(r for r in rows if r.get("budget")).items()}


def summarise(result: dict, label: Callable[[str], str], unigram: dict | None = None) -> str:
    """The equal wall-clock tables, one per budget: every model at its best rate at that
    budget, its loss against dense's and against the narrower dense model of its size."""
    rows = [r for r in result["rows"] if r.get("budget")]
    if not rows:
        return ""
    dense_row = next((r for r in rows if r["method"] == "dense"), None)
    # without dense's rows (a call of widths alone), its budget is the longest run's seconds
    budget_s = (dense_row["steps"] * dense_row["budget"]["step_ms"] / 1000 if dense_row
                else max(r["budget"]["seconds"] for r in rows))
    buys = (f"dense's {dense_row['steps']} steps ({budget_s:.0f} s)" if dense_row
            else f"dense's wall-clock (about {budget_s:.0f} s; dense is not in these rows)")
    run = next(r for r in reversed(result["runs"]) if "--equal-time" in r["command"])
    m, settings = run["machine"], run.get("settings", {})
    d_model = settings.get("d_model") or "the task's"
    lines = [f"# Causal LM (d_model {d_model}) at equal wall-clock: every model trains the steps "
             "its step time buys", "",
             f"Each model trains for as many steps as its median training step (measured side "
             f"by side on a quiet machine by `benchmarks.studies.lm_clock`, {m['cpu']}, "
             f"{m['threads']} thread) buys in {buys}, {settings.get('schedule', '?')} "
             f"learning rate after {settings.get('warmup', '?')} warm-up steps: with the "
             "constant schedule the run cut at a fraction of its steps is the run of that "
             "budget. Each model at the rate of one shared grid whose mean validation loss is "
             "best at that budget (\"at the edge\" where it is the grid's first or last); the "
             "spread is the sd over seeds. The formats' block linear layers at the largest "
             "uniform rank within dense / target; narrow: dense at the width whose whole model "
             "holds as many parameters as the compressed one. Step ms, peak and FLOPs per step "
             "from the clock (`lm_clock_cpu.md`); GFLOPs: to this budget.", ""]
    if unigram:
        lines += [f"Majority-class baseline (every position predicts the training tokens' "
                  f"frequencies): val loss {unigram['val']:.4f}, test {unigram['test']:.4f}.",
                  ""]
    for fraction in [f for f in FRACTIONS if all(_has(r, f) for r in rows)]:
        groups = at_budget(rows, fraction)
        dense_rows = next((g for (t, meth), (g, _) in groups.items() if meth == "dense"), [])
        dense = statistics.fmean(_loss_at(r, fraction) for r in dense_rows) if dense_rows \
            else float("nan")
        narrow = {t: statistics.fmean(_loss_at(r, fraction) for r in g)
                  for (t, meth), (g, _) in groups.items() if meth == "narrow"}
        seconds = fraction * budget_s
        lines += [f"## Budget {fraction:g} of dense's wall-clock ({seconds:.0f} s)", "",
                  "| target | model | seeds | steps | lr | val loss (mean ± sd) | vs dense "
                  "| vs narrow (same size) | step ms | step peak MiB | GFLOPs |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for (target, method), (group, lr) in sorted(
                groups.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1] != "narrow",
                                                kv[0][1])):
            losses = [_loss_at(r, fraction) for r in group]
            mean = statistics.fmean(losses)
            b = group[0]["budget"]
            steps = round(fraction * group[0]["steps"])
            vs_narrow = (f"{mean / narrow[target] - 1:+.2%}"
                         if target in narrow and method != "narrow" else "-")
            gflops = "-" if b.get("gflops_step") is None else f"{steps * b['gflops_step']:,.0f}"
            peak = "-" if b.get("peak_mib") is None else f"{b['peak_mib']:.0f}"
            lines.append(
                f"| {f'{target:g}x' if target else '-'} | {label(method)} | {len(group)} | "
                f"{steps} | {lr} | {mean_sd(losses)} | "
                f"{f'{mean / dense - 1:+.2%}' if dense_rows else '-'} | {vs_narrow} | "
                f"{b['step_ms']:.0f} | {peak} | {gflops} |")
        lines.append("")
    lines += reach_table(rows, label)
    lines += ["Commands (one per model and rate):", ""]
    lines += [f"    {r['command']}" for r in result["runs"] if "--equal-time" in r["command"]]
    return "\n".join(lines) + "\n"


def time_to(curve: list[list[float]], goal: float) -> float | None:
    """The first fraction of the budget at which ``curve`` ([fraction, loss] points) reaches
    ``goal``, linear between evaluations; None when it never does."""
    for (f0, l0), (f1, l1) in itertools.pairwise(curve):
        if l1 <= goal:
            return f1 if l0 <= goal or l0 == l1 else f0 + (f1 - f0) * (l0 - goal) / (l0 - l1)
    return None


def reach_table(rows: list[dict], label: Callable[[str], str]) -> list[str]:
    """Per model (at its best rate for the whole budget): the share of dense's wall-clock it
    takes to reach dense's final validation loss (both means over seeds)."""
    groups = at_budget(rows, 1.0)
    dense = next((g for (t, m), (g, _) in groups.items() if m == "dense"), None)
    if not dense:
        return []
    fractions = [f for f, _ in dense[0]["budget"]["val_at"]]
    goal = statistics.fmean(_loss_at(r, 1.0) for r in dense)
    lines = [f"## Time to dense's final validation loss ({goal:.4f})", "",
             "Mean curve over seeds at the model's best rate for the whole budget, linear "
             "between evaluations.", "", "| target | model | seeds | share of dense's "
             "wall-clock |", "|---|---|---|---|"]
    for (target, method), (group, _) in sorted(
            groups.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1] != "narrow", kv[0][1])):
        if method == "dense" or not all(_has(r, f) for r in group for f in fractions):
            continue
        curve = [[f, statistics.fmean(_loss_at(r, f) for r in group)] for f in fractions]
        share = time_to(curve, goal)
        lines.append(f"| {f'{target:g}x' if target else '-'} | {label(method)} | {len(group)} | "
                     f"{'not reached' if share is None else f'{share:.2f}'} |")
    return [*lines, ""]


def plot(result: dict, path: Path, label: Callable[[str], str]) -> bool:
    """Validation loss against wall-clock (top) and against FLOPs (bottom), one panel per
    target: each model's mean over seeds at its best rate at the full budget; dense in every
    panel. False without matplotlib or rows."""
    from benchmarks.studies.harness.results import _pyplot

    plt = _pyplot()
    rows = [r for r in result["rows"] if r.get("budget")]
    targets = sorted({r["target"] for r in rows if r.get("target")})
    if plt is None or not targets:
        return False
    groups = at_budget(rows, 1.0)
    fig, axes = plt.subplots(2, len(targets), figsize=(4.2 * len(targets), 7.2), sharey=True,
                             squeeze=False)
    for col, target in enumerate(targets):
        for (t, method), (group, _) in sorted(groups.items(), key=lambda kv: kv[0][1]):
            if t not in (None, target):
                continue
            b = group[0]["budget"]
            fractions = [f for f, _ in b["val_at"] if f > 0]
            losses = [statistics.fmean(_loss_at(r, f) for r in group) for f in fractions]
            steps = [f * group[0]["steps"] for f in fractions]
            style = {"color": "k", "lw": 2} if method == "dense" else (
                {"color": "grey", "lw": 2, "ls": "--"} if method == "narrow" else (
                    {"color": "grey", "lw": 1, "ls": ":"} if method.startswith("dense@")
                    else {}))
            name = label(method).replace(" at a uniform rank", "").replace(
                " (balanced parametrization)", "")
            axes[0][col].plot([s * b["step_ms"] / 1000 for s in steps], losses, marker=".",
                              label=name, **style)
            if b.get("gflops_step"):
                axes[1][col].plot([s * b["gflops_step"] / 1000 for s in steps], losses,
                                  marker=".", label=name, **style)
        axes[0][col].set_title(f"formats at {target:g}x (block layers)", fontsize=10)
        axes[0][col].set_xlabel("training wall-clock (s; steps x measured step time)")
        axes[1][col].set_xlabel("training TFLOPs (counted)")
        axes[1][col].set_xscale("log")
    for row in axes:
        row[0].set_ylabel("validation loss")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Causal LM: validation loss at equal wall-clock\n(mean over seeds, each "
                 "model at its best rate)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
