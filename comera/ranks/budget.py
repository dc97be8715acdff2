"""Budgets: a compression target as a parameter count, and the largest uniform rank within one.

Two rules that conversion, the rank stages, the uniform allocation, the benchmarks and the
studies all follow, each written once here:

- :func:`size_target`: the model size at which chosen gated layers are ``ratio`` times below
  their dense size, every other parameter kept as it is now (a hot-row cache counts with its
  table, as :func:`comera.ranks.size.model_size` counts it).
- :func:`largest_rank`: the largest uniform rank whose size fits a budget. A uniform int rank
  is capped per bond (a larger rank only adds zero directions), so the size grows with the
  rank until every bond is at its cap and then stays; the search answers the smallest rank of
  that size (every larger one builds the same layers). :func:`uniform_rank` is it for linear
  layers of any registered format, sized from their layouts alone (no cores are drawn).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from torch import nn

from comera.errors import ConfigError
from comera.formats.registry import Format, get_format
from comera.layers.linear import resolve_modes
from comera.numbers import is_int
from comera.ranks.size import gated_layers, layers_size, model_size

__all__ = ["MAX_RANK", "Shape", "check_ratio", "dense_linear_size", "largest_rank",
           "layout_size", "linear_size", "select_layers", "size_target", "uniform_rank"]

MAX_RANK = 1 << 16  # the searches try ranks up to this
Shape = tuple[int, int, bool]  # a linear layer: (in_features, out_features, bias)


def check_ratio(ratio: float, what: str = "ratio") -> float:
    """``ratio`` as a compression against dense (a finite number > 1), else a
    :class:`ConfigError` naming it."""
    try:
        finite = (not isinstance(ratio, bool) and isinstance(ratio, int | float)
                  and math.isfinite(float(ratio)))
    except OverflowError:  # an int too large for a float
        finite = False
    if not (finite and ratio > 1):
        shown = (f"<an int of {len(str(abs(ratio)))} digits>" if isinstance(ratio, int)
                 and not isinstance(ratio, bool) and abs(ratio) >= 10**30 else repr(ratio))
        raise ConfigError(f"{what}={shown}; a compression against dense is a finite number > 1 "
                          "(10 keeps a tenth of the dense parameters).")
    return float(ratio)


def select_layers(model: nn.Module, of=None) -> list[tuple[str, nn.Module]]:
    """The gated layers ``of`` names: a layer type or tuple of types (e.g. ``comera.TTLinear``),
    or qualified module names (a str or a list; a name also takes the gated layers under it);
    None: every gated layer. A ConfigError lists what there is when nothing matches."""
    layers = list(gated_layers(model))
    if not layers:
        raise ConfigError("the model has no TT layers: convert it with comera.convert_ first.")
    if of is None:
        chosen = layers
    elif isinstance(of, type) or (isinstance(of, tuple) and of and
                                   all(isinstance(t, type) for t in of)):
        chosen = [(n, m) for n, m in layers if isinstance(m, of)]
    else:
        names = [of] if isinstance(of, str) else list(of)
        if not names or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"of={of!r}; give a layer type, a tuple of types, or module "
                              "names (str).")
        chosen = [(n, m) for n, m in layers
                  if any(want in ("", n) or n.startswith(want + ".") for want in names)]
    if not chosen:
        have = ", ".join(n or "<model>" for n, _ in layers[:8]) or "none"
        raise ConfigError(f"of={of!r} matches no TT layer of the model (its TT layers: {have}"
                          f"{' ...' if len(layers) > 8 else ''}); name some of them, or leave "
                          "of out for all.")
    return chosen


def size_target(model: nn.Module, ratio: float, of=None) -> float:
    """The model size (parameters, as :func:`~comera.ranks.size.model_size` counts them) at
    which the gated layers ``of`` (see :func:`select_layers`) are ``ratio`` times below their
    dense size, every other parameter kept as it is now."""
    ratio = check_ratio(ratio)
    params, dense = layers_size(model, [m for _, m in select_layers(model, of)])
    return dense / ratio + (model_size(model) - params)


def largest_rank(size: Callable[[int], float], budget: float, limit: int = MAX_RANK) -> int:
    """The largest uniform rank r in [1, ``limit``] with ``size(r) <= budget``, or where the size
    stops growing, the smallest rank of that size; 0 when not even rank 1 fits.

    ``size`` must not shrink as the rank grows (it is called O(log limit) times)."""
    if not is_int(limit):
        raise ConfigError(f"limit={limit!r}; the highest rank tried is an int >= 1.")
    seen: dict[int, float] = {}

    def at(r: int) -> float:
        if r not in seen:
            seen[r] = size(r)
        return seen[r]

    if at(1) > budget:
        return 0
    lo, hi = 1, 1
    while at(hi) <= budget and hi < limit:  # double until over the budget (or the limit)
        lo, hi = hi, min(2 * hi, limit)
    if at(hi) <= budget:
        lo = hi
    while hi - lo > 1:  # at(lo) fits, at(hi) does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if at(mid) <= budget else (lo, mid)
    first, top = 1, lo  # the smallest rank whose size is at(lo)
    while first < top:
        mid = (first + top) // 2
        first, top = (mid + 1, top) if at(mid) < at(lo) else (first, mid)
    return first


def layout_size(fmt: Format | str, in_modes: Sequence[int], out_modes: Sequence[int],
                rank: int) -> int:
    """Parameters of ``fmt``'s cores on these modes at the uniform int ``rank``."""
    layout = get_format(fmt).layout(tuple(in_modes), tuple(out_modes), rank)
    return layout.parameters_at(layout.bond_sizes)


def linear_size(fmt: Format | str, shapes: Iterable[Shape], rank: int, d: int = 3) -> int:
    """Parameters (biases included) of ``GatedLinear(i, o, format=fmt, ranks=rank, d=d)`` for
    every ``(i, o, bias)`` of ``shapes``, from the layouts alone."""
    fmt = get_format(fmt)
    total = 0
    for n_in, n_out, bias in shapes:
        modes = (resolve_modes(n_in, n_out, None, None, d) if fmt.uses_modes
                 else ((n_in,), (n_out,)))
        total += layout_size(fmt, *modes, rank) + (n_out if bias else 0)
    return total


def dense_linear_size(shapes: Iterable[Shape]) -> int:
    """Parameters of dense layers of ``shapes`` (weights and biases)."""
    return sum(n_in * n_out + (n_out if bias else 0) for n_in, n_out, bias in shapes)


def uniform_rank(fmt: Format | str, shapes: Sequence[Shape], budget: float, d: int = 3,
                 limit: int = MAX_RANK) -> int:
    """The largest uniform rank at which linear layers of ``shapes`` in ``fmt`` hold at most
    ``budget`` parameters (:func:`largest_rank` of :func:`linear_size`; 0 when rank 1 is over)."""
    shapes = list(shapes)
    return largest_rank(lambda r: linear_size(fmt, shapes, r, d), budget, limit)
