"""Pictures of an experiment's summary: training curves, rank evolution, compression vs score.

matplotlib is optional (``pip install -e '.[plot]'`` in the checkout): without it the plots
are skipped with a warning and the JSON / markdown files still hold every number.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tncomp.files import atomic_write_bytes

log = logging.getLogger("comera.experiments")


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        log.warning("matplotlib is not installed: plots skipped (pip install -e '.[plot]' in "
                    "the checkout)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


Writer = Callable[[Path, Callable[[Path], None]], None]


def _plain_write(path: Path, write: Callable[[Path], None]) -> None:
    write(path)


def write_plots(summary: dict[str, Any], out: Path, write: Writer = _plain_write) -> list[Path]:
    """Write ``<task>_curves.png``, ``<task>_ranks.png`` and ``<task>_tradeoff.png``, each
    atomically (a planted link is replaced, not written through). ``write(path, writer)``
    runs each file's writer (the summary's turns its ``OSError`` into one clear error)."""
    def _save(fig, plt, path: Path) -> Path:
        write(path, lambda p: _save_figure(fig, plt, p))
        return path

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
        fig = ranks_figure(plt, tt_runs[0], summary["config"],
                           f"{name}: ranks per layer ({tt_runs[0]['name']})")
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


def layer_kind(name: str) -> tuple[str, str]:
    """(kind, instance) of a layer name: the name without its numbered parts, and those parts:
    "blocks.3.attn.q" -> ("blocks.attn.q", "3"), "embeddings.12" -> ("embeddings", "12"),
    "tokens" -> ("tokens", "")."""
    parts = name.split(".")
    kind = ".".join(p for p in parts if not p.isdigit()) or name
    return kind, ".".join(p for p in parts if p.isdigit())


def ranks_figure(plt, run: dict[str, Any], config: dict[str, Any], title: str):
    """The rank evolution of one run, as a figure. Left: one labelled row per layer, grouped by
    kind, coloured by its rank sum as a share of the first evaluation's, so dozens of layers
    stay apart. Right: the rank sum per layer kind (q, k, v, o, feed-forward, embedding...),
    one labelled line each."""
    import numpy as np

    steps = [s for s, _ in run["ranks"]]
    layers = sorted({n for _, ranks in run["ranks"] for n in ranks},
                    key=lambda n: (layer_kind(n)[0], _natural(layer_kind(n)[1])))
    sums = np.array([[sum(ranks.get(n, [0])) for _, ranks in run["ranks"]] for n in layers],
                    dtype=float)  # (layers, evaluations)
    share = sums / np.maximum(sums[:, :1], 1)
    fig, (ax_map, ax_kind) = plt.subplots(
        1, 2, figsize=(12, max(4.0, 0.2 * len(layers) + 1.5)),
        gridspec_kw={"width_ratios": [3, 2]})
    image = ax_map.imshow(share, aspect="auto", cmap="viridis", vmin=0, vmax=1,
                          interpolation="nearest")
    ax_map.set_yticks(range(len(layers)), layers, fontsize=max(5, min(8, 300 // len(layers))))
    ticks = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), 8)).round().astype(int))
    ax_map.set_xticks(ticks, [str(steps[t]) for t in ticks])
    ax_map.set_xlabel("step (evaluations)")
    kinds = [layer_kind(n)[0] for n in layers]
    for row in range(1, len(layers)):  # a rule between kinds
        if kinds[row] != kinds[row - 1]:
            ax_map.axhline(row - 0.5, color="white", lw=1)
    fig.colorbar(image, ax=ax_map, label="sum of ranks / at the first evaluation")
    by_kind: dict[str, np.ndarray] = {}
    for kind, row in zip(kinds, sums, strict=True):
        by_kind[kind] = by_kind.get(kind, 0) + row
    for kind, total in by_kind.items():
        count = kinds.count(kind)
        ax_kind.plot(steps, total, marker="o", ms=2, lw=1.2,
                     label=f"{kind} ({count} layer{'s' if count > 1 else ''})")
    if config.get("stage") != "early" and config.get("steps_late"):
        ax_kind.axvline(config["steps_early"], color="grey", ls=":", lw=1,
                        label="late stage starts")
        late = [k for k, step in enumerate(steps) if step > config["steps_early"]]
        if late:  # between the last early evaluation and the first late one
            ax_map.axvline(late[0] - 0.5, color="white", ls=":", lw=1.5)
    ax_kind.set_xlabel("step")
    ax_kind.set_ylabel("sum of effective TT ranks, per layer kind")
    ax_kind.legend(fontsize=7)
    fig.suptitle(title)
    return fig


def _natural(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())


def _smooth(values: list[float], window: int = 20) -> list[float]:
    out, acc = [], 0.0
    for k, v in enumerate(values):
        acc += v
        if k >= window:
            acc -= values[k - window]
        out.append(acc / min(k + 1, window))
    return out


def _save_figure(fig, plt, path: Path) -> None:
    """The figure as a PNG at ``path``, rendered in memory and written atomically."""
    try:
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=110)
    finally:
        plt.close(fig)
    atomic_write_bytes(path, buffer.getbuffer())
