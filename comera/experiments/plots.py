"""Pictures of an experiment's summary: training curves, rank evolution, compression vs score.

matplotlib is optional (``pip install 'tncomp[plot]'``): without it the plots are skipped with a
warning and the JSON / markdown files still hold every number.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("comera.experiments")


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        log.warning("matplotlib is not installed: plots skipped (pip install 'tncomp[plot]')")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(summary: dict[str, Any], out: Path) -> list[Path]:
    """Write ``<task>_curves.png``, ``<task>_ranks.png`` and ``<task>_tradeoff.png``."""
    plt = _pyplot()
    if plt is None:
        return []
    name, metric = summary["task"], summary["metric"]
    paths = []

    fig, (ax_loss, ax_metric) = plt.subplots(1, 2, figsize=(11, 4))
    for run in summary["runs"]:
        steps = [p[0] for p in run["train_curve"]]
        losses = [p[1] for p in run["train_curve"]]
        if steps:
            ax_loss.plot(steps, _smooth(losses), label=run["name"])
        val = [(s, scores[metric]) for s, scores in run["val_curve"]]
        if val:
            ax_metric.plot(*zip(*val, strict=True), marker="o", ms=3, label=run["name"])
    late = summary["config"]["steps_early"]
    for ax in (ax_loss, ax_metric):
        if summary["config"]["stage"] != "early" and summary["config"]["steps_late"]:
            ax.axvline(late, color="grey", ls=":", lw=1, label="late stage starts")
        ax.set_xlabel("step")
        ax.legend()
    ax_loss.set_ylabel("training loss (smoothed)")
    ax_metric.set_ylabel(f"validation {metric}")
    fig.suptitle(f"{name}: dense vs CoMERA")
    paths.append(_save(fig, plt, out / f"{name}_curves.png"))

    tt_runs = [r for r in summary["runs"] if r["ranks"]]
    if tt_runs:
        run = tt_runs[0]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        layers = list(run["ranks"][0][1])
        for layer in layers:
            steps = [s for s, ranks in run["ranks"]]
            total = [sum(ranks[layer]) for _, ranks in run["ranks"]]
            ax.plot(steps, total, lw=1, label=layer if len(layers) <= 12 else None)
        ax.set_xlabel("step")
        ax.set_ylabel("sum of TT ranks (effective)")
        ax.set_title(f"{name}: rank evolution per layer ({run['name']})")
        if len(layers) <= 12:
            ax.legend(fontsize=6)
        paths.append(_save(fig, plt, out / f"{name}_ranks.png"))

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for row in summary["rows"]:
        comp = row["sizes"].get("tt_compression", 1.0)
        ax.scatter([comp], [row["test"][metric]], s=40)
        ax.annotate(row["name"], (comp, row["test"][metric]), fontsize=8,
                    xytext=(4, 4), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("compression of the TT layers (dense size / TT size)")
    ax.set_ylabel(f"test {metric}")
    ax.set_title(f"{name}: compression vs {metric}")
    paths.append(_save(fig, plt, out / f"{name}_tradeoff.png"))
    return paths


def _smooth(values: list[float], window: int = 20) -> list[float]:
    out, acc = [], 0.0
    for k, v in enumerate(values):
        acc += v
        if k >= window:
            acc -= values[k - window]
        out.append(acc / min(k + 1, window))
    return out


def _save(fig, plt, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
