"""The ``ranks=`` argument of a format with one rank per bond, checked and capped in one place,
and the rule that says when an int rank is so high that every bond is capped (the layer is then
exact and compresses nothing): :func:`full_rank`, which a layer built with such a rank warns
about (:class:`FullRankWarning`) as ``convert_`` does."""

from __future__ import annotations

import operator
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from comera.errors import ConfigError
from comera.numbers import is_int

if TYPE_CHECKING:
    from comera.formats.layout import Layout

Ranks = int | Sequence[int]


class FullRankWarning(UserWarning):
    """An int rank at or above the full rank of a layer's layout: every bond is clipped at its
    cap, so the layer is exact and compresses nothing."""


def full_rank(fmt: Any, layout: Layout, rank: int) -> int | None:
    """The largest bond the format ``fmt`` allows on ``layout``'s modes when asked for ``rank``
    or more (the bonds are clipped there), or None when ``rank`` is below every cap."""
    at = fmt.layout(layout.in_modes, layout.out_modes, rank).bond_sizes
    above = fmt.layout(layout.in_modes, layout.out_modes, rank + 1).bond_sizes
    return max(at, default=1) if at == above else None


def warn_full_rank(fmt: Any, layout: Layout, ranks: Ranks, what: str) -> None:
    """Warn (:class:`FullRankWarning`, naming ``what``) when the int ``ranks`` reaches the full
    rank of ``layout`` in ``fmt``: a layer asked for more rank than its bonds can hold is
    clipped, and should say so rather than compress nothing silently."""
    if not is_int(ranks, None):
        return
    cap = full_rank(fmt, layout, ranks)
    if cap is not None:
        warnings.warn(f"{what}: ranks={ranks} reaches the full rank of its {fmt.name} layout "
                      f"(every bond clipped at its cap, the largest {cap}): the layer is exact "
                      "and compresses nothing. Lower ranks to compress.", FullRankWarning,
                      stacklevel=3)


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


def rank_sequence(ranks: Sequence[Any], n: int, kind: str, layer: str,
                  give: str) -> tuple[int, ...]:
    """``ranks`` (a sequence, one per bond) as a tuple of ``n`` ints >= 1, else a ConfigError
    naming the ``layer`` (e.g. "a ring of 6 cores"), the fix (``give``) and the ``kind`` of rank."""
    ranks = tuple(ranks)
    if len(ranks) != n:
        raise ConfigError(f"ranks {ranks} has {len(ranks)} entries for {layer}; give {give}.")
    for r in ranks:
        if not is_int(r):
            raise ConfigError(f"ranks {ranks} holds {r!r}; every {kind} rank is an int >= 1.")
    return ranks
