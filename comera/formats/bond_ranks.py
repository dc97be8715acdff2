"""The ``ranks=`` argument of a format with one rank per bond, checked and capped in one place."""

from __future__ import annotations

import operator
from collections.abc import Sequence

from comera.errors import ConfigError

Ranks = int | Sequence[int]


def resolve_bond_ranks(ranks: Ranks, caps: Sequence[int], what: str = "ranks") -> tuple[int, ...]:
    """One rank per bond from ``ranks``: an int is every bond's rank, capped at ``caps[k]`` (a
    larger rank only adds zero directions); a sequence gives each bond's rank, at most its cap.
    Anything else raises :class:`ConfigError` naming the value."""
    caps = tuple(caps)
    if isinstance(ranks, Sequence) and not isinstance(ranks, (str, bytes)):
        if len(ranks) != len(caps):
            raise ConfigError(f"{what}={tuple(ranks)!r} has {len(ranks)} entries for {len(caps)} "
                              f"bonds; give {len(caps)} ranks, or one int for all.")
        values = tuple(_rank(r, f"{what}[{k}]") for k, r in enumerate(ranks))
        for k, (r, cap) in enumerate(zip(values, caps, strict=True)):
            if r > cap:
                raise ConfigError(f"{what}[{k}]={r} is above {cap}, the largest rank bond {k} can "
                                  f"use; give at most {cap} (an int rank is capped per bond).")
        return values
    rank = _rank(ranks, what)
    return tuple(min(rank, cap) for cap in caps)


def _rank(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{what}={value!r}; a rank is an int >= 1, not a bool.")
    try:
        rank = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"{what}={value!r}; a rank is an int >= 1 (or give a sequence of "
                          "ints, one per bond).") from None
    if rank < 1:
        raise ConfigError(f"{what}={rank}; a rank is at least 1.")
    return rank
