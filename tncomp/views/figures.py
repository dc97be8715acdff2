"""Figure helpers shared by the pictures: matplotlib on demand, output paths, a bare Agg figure.

Matplotlib is optional (``pip install -e '.[plot]'`` in the checkout) and imported only when a
picture is made, on a bare ``Figure`` with the Agg canvas: no pyplot, no backend switch, no
global state.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

from tncomp.errors import PlotDependencyError, PlotError
from tncomp.files import atomic_write_bytes

log = logging.getLogger("tncomp.views.figures")

DPI = 120


def require_matplotlib() -> tuple[type, type]:
    """``(Figure, FigureCanvasAgg)``, or a :class:`PlotDependencyError` saying what to install."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        missing = exc.name or "matplotlib"
        raise PlotDependencyError(
            f"pictures need matplotlib, which could not be imported (no {missing!r}); install "
            "it with: pip install -e '.[plot]' in the tncomp checkout (or pip install matplotlib)"
        ) from None
    return Figure, FigureCanvasAgg


def check_output_path(path: str | Path) -> Path:
    """``path`` as a Path if matplotlib can write a picture there, else a :class:`PlotError`."""
    _, canvas = require_matplotlib()
    path = Path(path)
    supported = sorted(canvas.get_supported_filetypes())
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in supported:
        what = f"has suffix .{suffix}" if suffix else "has no suffix"
        raise PlotError(f"output {str(path)!r} {what}; name a picture file such as net.png "
                        f"(formats: {', '.join(supported)}).")
    if path.is_dir():
        raise PlotError(f"output {str(path)!r} is a directory; give a file name such as "
                        f"{path / 'net.png'}.")
    if not path.parent.is_dir():
        raise PlotError(f"output {str(path)!r}: directory {str(path.parent)!r} does not exist; "
                        "create it first.")
    return path


def new_figure(width: float, height: float, ncols: int) -> tuple[Any, list[Any]]:
    """A Figure on an Agg canvas and its ``ncols`` axes in one row."""
    figure_cls, canvas_cls = require_matplotlib()
    fig = figure_cls(figsize=(width, height), layout="constrained")
    canvas_cls(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def save_figure(fig: Any, path: Path) -> None:
    """Write ``fig`` to ``path`` (the format from its suffix) atomically, replacing a link at
    ``path`` rather than writing through it; a failed write is a PlotError."""
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=DPI, format=Path(path).suffix.lstrip(".").lower() or None)
    try:
        atomic_write_bytes(path, buffer.getvalue())
    except OSError as exc:
        raise PlotError(f"could not write {str(path)!r}: {exc}") from None
    log.info("wrote %s", path)


def format_count(value: float, unit: str) -> str:
    """``1.23 GFLOP``-style text of a count."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"
