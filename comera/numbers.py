"""What counts as a whole number in a setting: one rule for every check in comera (a bool is an
int to Python, never to a user), so each caller only writes its own error message."""

from __future__ import annotations

import operator

__all__ = ["as_whole", "is_int"]


def is_int(value: object, low: int | None = 1, high: int | None = None) -> bool:
    """True when ``value`` is an ``int`` (not a ``bool``) in ``[low, high]`` (either bound
    None: unbounded on that side)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return (low is None or value >= low) and (high is None or value <= high)


def as_whole(value: object, what: str, minimum: int, error: type[Exception], *,
             not_int: str = "", too_low: str = "") -> int:
    """``value`` as an int >= ``minimum`` (anything ``operator.index`` takes, never a bool), else
    ``error`` saying which of the three it was; ``not_int`` / ``too_low`` end those messages
    (the caller's hint)."""
    said = f"{what} must be an int >= {minimum}, got"
    if isinstance(value, bool):
        raise error(f"{said} the bool {value!r}")
    try:
        result = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise error(f"{said} {type(value).__name__} {value!r}{not_int}") from None
    if result < minimum:
        raise error(f"{said} {result}{too_low}")
    return result
