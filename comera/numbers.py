"""What counts as a whole number in a setting: one rule for every check in comera (a bool is an
int to Python, never to a user), so each caller only writes its own error message."""

from __future__ import annotations

__all__ = ["is_int"]


def is_int(value: object, low: int | None = 1, high: int | None = None) -> bool:
    """True when ``value`` is an ``int`` (not a ``bool``) in ``[low, high]`` (either bound
    None: unbounded on that side)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return (low is None or value >= low) and (high is None or value <= high)
