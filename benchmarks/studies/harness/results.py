"""A study's results: the committed summary and the git-ignored curves, runs files, the
learning rate each method takes from the shared grid, and the plots.

Results are data, not history: what is committed under ``benchmarks/results/<study>/`` is the
tables, the plots and a summary JSON whose rows carry no per-step curves
(:func:`write_summary`); the curves, and every per-run copy, go to the study's ``curves/``
folder beside it, which git ignores and the study's command regenerates.

Every call of a study writes its rows, curves included, to ``<out>/curves/runs/<tag>.json``
after every model (so a cut-off run keeps what it finished, and calls with different tags run
side by side), and :func:`merge` joins them with the rows the committed summary holds for the
tags not run here. Each row carries the learning rate it trained at; where a method ran at
several, :func:`at_best_lr` keeps the rows of the rate whose mean validation score is best on
the seeds the rates share (one shared grid, each method its own rate, chosen on validation
data only).
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from comera.experiments.results import machine
from tncomp.files import atomic_write_text

__all__ = ["CURVES", "RunsFile", "at_best_lr", "best_lrs", "by_method", "curves_path",
           "mean_sd", "merge", "plot_curves", "plot_points", "read_summary", "without_curves",
           "write_summary"]

CURVES = "curves"  # the git-ignored folder beside a study's committed results


def without_curves(value: Any) -> Any:
    """``value`` with every ``"curves"`` entry dropped, at any depth (a row's per-step data
    lives under that one key in every study)."""
    if isinstance(value, dict):
        return {k: without_curves(v) for k, v in value.items() if k != CURVES}
    if isinstance(value, list):
        return [without_curves(v) for v in value]
    return value


def curves_path(path: Path) -> Path:
    """Where the whole payload of the summary ``path`` goes: ``<folder>/curves/<name>``."""
    path = Path(path)
    return path.parent / CURVES / path.name


def write_summary(path: Path, payload: dict, *, curves: bool = True) -> Path:
    """Write the committed summary ``path``: ``payload`` without per-step curves. With
    ``curves`` (and curves in ``payload``), the whole payload goes to :func:`curves_path`
    too, where :func:`read_summary` finds it. Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    summary = without_curves(payload)
    atomic_write_text(path, json.dumps(summary, indent=1, default=str) + "\n")
    if curves and summary != payload:
        full = curves_path(path)
        full.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(full, json.dumps(payload, indent=1, default=str) + "\n")
    return path


def read_summary(path: Path) -> dict:
    """The summary ``path`` with its curves where this checkout has them: the whole payload
    at :func:`curves_path` when it matches the summary once its curves are dropped (the two
    were written together), else the summary alone."""
    path = Path(path)
    summary = json.loads(path.read_text())
    full = curves_path(path)
    if full.is_file():
        payload = json.loads(full.read_text())
        if json.loads(json.dumps(without_curves(payload), default=str)) == summary:
            return payload
    return summary


def mean_sd(values: list[float], digits: int = 4) -> str:
    """``mean ± sd`` of ``values`` (sd nan for one value)."""
    sd = statistics.stdev(values) if len(values) > 1 else float("nan")
    return f"{statistics.fmean(values):.{digits}f} ± {sd:.{digits}f}"


class RunsFile:
    """One call's rows, curves included, in ``<out>/curves/runs/<tag>.json`` (git-ignored):
    the data described, the machine, the command that made them and its settings;
    :meth:`save` rewrites it (atomically)."""

    def __init__(self, out: Path, tag: str, module: str, data: dict, settings: dict,
                 argv: list[str] | None = None):
        self.path = Path(out) / CURVES / "runs" / f"{tag}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        args = sys.argv[1:] if argv is None else argv
        self.payload = {"tag": tag, "data": data, "machine": machine(),
                        "command": f"python -m {module} " + shlex.join(args),
                        "settings": {k: str(v) if isinstance(v, Path) else v
                                     for k, v in settings.items()}, "rows": []}

    @property
    def rows(self) -> list[dict]:
        return self.payload["rows"]

    def add(self, rows: Iterable[dict]) -> None:
        """Append ``rows`` and save."""
        self.rows.extend(rows)
        self.save()

    def save(self) -> None:
        atomic_write_text(self.path, json.dumps(self.payload, indent=1, default=str))


def merge(out: Path, title: str, upgrade: Callable[[dict], dict] = lambda r: r,
          summary: str = "frontier.json") -> dict:
    """One result of every run: the runs files under ``<out>/curves/runs/`` (rows with
    curves) and, for each tag without one here, the runs and rows the committed summary
    ``<out>/<summary>`` holds (rows whose curves are not here: ``"curves": None``). Runs in
    the order of their files' names, rows concatenated,
    each tagged with its run and passed through ``upgrade``; the settings, machine and command
    of every run."""
    out = Path(out)
    runs: dict[str, dict] = {}
    if (out / summary).is_file():
        committed = json.loads((out / summary).read_text())
        for run in committed.get("runs", []):  # curves None: made, but not here
            runs[run["tag"]] = run | {"rows": [r | {CURVES: None} for r in committed["rows"]
                                               if r.get("tag") == run["tag"]]}
    for path in sorted((out / CURVES / "runs").glob("*.json")):
        run = json.loads(path.read_text())
        runs[run["tag"]] = run  # a run made here replaces the committed one of its tag
    ordered = [runs[tag] for tag in sorted(runs, key=lambda t: f"{t}.json")]  # file order
    rows = [upgrade({"tag": r["tag"], **row}) for r in ordered for row in r["rows"]]
    return {"task": title, "data": ordered[0]["data"] if ordered else {},
            "runs": [{k: v for k, v in r.items() if k != "rows"} for r in ordered],
            "rows": rows}


def by_method(rows: Iterable[dict], key: str = "method") -> dict[tuple, list[dict]]:
    """Rows grouped by (target, method)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row.get("target"), row[key]), []).append(row)
    return groups


def best_lrs(rows: list[dict], score: Callable[[dict], float],
             lower: bool = True) -> tuple[float | None, list[float]]:
    """(the best learning rate, every rate tried); a row without one (made before the grid)
    counts as its own rate, None.

    Rates are compared pairwise on the seeds both ran (a grid on seed 0, then more seeds at the
    best, compares the grid on seed 0 alone and the top rates on every seed they share): the best
    is the rate whose mean beats every other's there; without such a rate, the best mean over
    all rows."""
    rates: dict[Any, dict[Any, list[float]]] = {}
    for row in rows:
        rates.setdefault(row.get("lr"), {}).setdefault(row.get("seed"), []).append(score(row))
    sign = 1.0 if lower else -1.0

    def mean(lr, seeds) -> float:
        return statistics.fmean(v for seed in seeds for v in rates[lr][seed])

    def beats(a, b) -> bool:  # on the seeds both ran (each its own where they share none)
        shared = rates[a].keys() & rates[b].keys()
        return (sign * mean(a, shared or rates[a].keys())
                <= sign * mean(b, shared or rates[b].keys()))

    winners = [lr for lr in rates if all(beats(lr, other) for other in rates if other != lr)]
    pick = winners[0] if len(winners) == 1 else min(
        winners or rates, key=lambda lr: sign * mean(lr, rates[lr].keys()))
    return pick, sorted(lr for lr in rates if lr is not None)


def at_best_lr(rows: list[dict], score: Callable[[dict], float],
               lower: bool = True) -> tuple[list[dict], str]:
    """The rows at the best learning rate (:func:`best_lrs`) and how it was chosen, e.g.
    ``"3e-3 of 1e-3..1e-2"`` (``", at the edge"`` when it is the grid's first or last)."""
    lr, grid = best_lrs(rows, score, lower)
    chosen = [r for r in rows if r.get("lr") == lr]
    if lr is None or len(grid) < 2:
        return chosen, "-" if lr is None else f"{lr:g}"
    edge = ", at the edge" if lr in (grid[0], grid[-1]) else ""
    return chosen, f"{lr:g} of {grid[0]:g}..{grid[-1]:g}{edge}"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_points(series: dict[str, list[tuple[float, float]]], path: Path, *, title: str,
                xlabel: str, ylabel: str, reference: tuple[str, list[float]] | None = None,
                lines: tuple[tuple[str, float], ...] = ()) -> bool:
    """A log-x scatter of (x, y) points per labelled series, with an optional reference band
    (label, values: mean line and ± sd band) and horizontal lines; False without
    matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    markers = iter(("^", "v", "o", "s", "x", "D", "P", "*", "<", ">", "h"))
    fig, ax = plt.subplots(figsize=(6.6, 4.3))
    if reference and reference[1]:
        label, values = reference
        mean = statistics.fmean(values)
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        ax.axhline(mean, color="k", lw=1, label=f"{label} (mean ± sd of {len(values)})")
        ax.axhspan(mean - sd, mean + sd, color="k", alpha=0.1)
    for label, y in lines:
        ax.axhline(y, color="grey", lw=0.8, ls=":", label=label)
    for label, points in series.items():
        if points:
            ax.scatter([p[0] for p in points], [p[1] for p in points],
                       marker=next(markers, "o"), label=label, alpha=0.8)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_curves(series: dict[str, list[dict]], path: Path, *, title: str, metric: str,
                time_label: str = "training wall-clock (s, this CPU)") -> bool:
    """Validation ``metric`` against the step (left) and the measured training wall-clock
    (right), one line per labelled group of rows (the mean over its seeds at each evaluation);
    rows without curves (made before rows had them) are left out. False, and ``path`` left as
    it is, without matplotlib, without curves, or when a row's curves are not in this checkout
    (``"curves": None``, as :func:`merge` marks the committed rows: the committed plot stays)."""
    plt = _pyplot()
    rows = [r for group in series.values() for r in group]
    if (plt is None or not any(r.get(CURVES) for r in rows)
            or any(CURVES in r and r[CURVES] is None for r in rows)):
        return False
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for label, rows in series.items():
        points = [[(s, t, scores[metric]) for s, t, scores in r["curves"]["val"]
                   if t is not None] for r in rows if r.get("curves")]
        if not points or not all(len(p) == len(points[0]) for p in points):
            continue
        mean = [tuple(statistics.fmean(p[k][i] for p in points) for i in range(3))
                for k in range(len(points[0]))]
        by_step.plot([m[0] for m in mean], [m[2] for m in mean], marker=".", label=label)
        by_time.plot([m[1] for m in mean], [m[2] for m in mean], marker=".", label=label)
    by_step.set_xlabel("training step")
    by_time.set_xlabel(time_label)
    by_step.set_ylabel(f"validation {metric}")
    by_step.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
