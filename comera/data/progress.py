"""Progress bars for preparing data sets: transient rich bars on stderr, shown only on a terminal.

Two shapes share one switch (:func:`progress_enabled`: an interactive stderr and no
``COMERA_NO_PROGRESS``): :func:`preparing_progress` counts items (files, sources) over one or
more tasks the caller adds, and :func:`progress_bar` follows one amount (rows, bytes) with a
percentage and the time remaining.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from comera.errors import ConfigError


def progress_enabled() -> bool:
    """Progress bars show on an interactive stderr unless ``COMERA_NO_PROGRESS`` is set."""
    return sys.stderr.isatty() and not os.environ.get("COMERA_NO_PROGRESS")


def _bar(*columns: ProgressColumn) -> Progress:
    """A transient bar on stderr: the description, the bar, then ``columns``."""
    return Progress(TextColumn("{task.description}"), BarColumn(), *columns,
                    console=Console(stderr=True), transient=True,
                    disable=not progress_enabled())


def preparing_progress() -> Progress:
    """A transient rich progress bar on stderr for preparing a data set (disabled when
    :func:`progress_enabled` is false), showing done / total items and the time elapsed. Use
    as a context manager and add tasks to it."""
    return _bar(MofNCompleteColumn(), TimeElapsedColumn())


@contextmanager
def progress_bar(description: str, total: float) -> Iterator[Callable[[float], None]]:
    """One transient task of ``total`` units with a percentage and the time remaining (disabled
    when :func:`progress_enabled` is false); yields ``advance(amount)``."""
    if not total >= 0:
        raise ConfigError(f"progress_bar {description!r} got total={total!r}; give a "
                          "non-negative amount (rows, bytes, ...).")
    with _bar(TextColumn("{task.percentage:>3.0f}%"), TimeRemainingColumn()) as bar:
        task = bar.add_task(description, total=total)
        yield lambda amount: bar.advance(task, amount)


__all__ = ["preparing_progress", "progress_bar", "progress_enabled"]
