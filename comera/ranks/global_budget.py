"""One size budget across many layers: the bond slices that remove the most truncation error per
parameter, wherever they are.

Each layer to compress comes with its layout (modes, cores, bonds) and, per bond, the singular
values of its weight unfolded at that bond (``Format.spectra``; of the *whitened* weight for a
calibrated conversion, so the squares are output-error energies). Keeping ``r`` slices of a bond
discards the energy of its singular values past ``r``, and the decomposition's squared relative
error ``e`` is at most the discarded shares of the energy summed over bonds (TT-SVD, HOSVD;
exact for one bond). Shares, not energies: layers of different scales compare.

:func:`allocate_budget` starts every bond at one slice and adds one slice at a time, the one that
lowers ``sum over layers of e^2`` the most per parameter it costs (a slice of share ``g`` in a
layer at ``e``: ``e^2 - (e - g)^2``), until no slice fits the budget. Squaring ``e`` weighs a
layer's error more the larger it is, so no layer is starved; spending by ``sum of e`` (each
share per parameter alone) gave a higher perplexity on the trained causal LM
(``docs/results.md``, issue 31). A slice costs
what the cores carrying its bond grow by (:meth:`Layout.slice_costs`, which changes as the
neighbouring bonds grow), a bond never exceeds what its spectrum holds or its cores allow
(:meth:`Layout.bond_caps`), and no layer grows past its dense size (``in x out``: beyond it the
factors would hold more than the matrix they stand for). Unlike
:func:`comera.ranks.allocate.allocate`, which reads a built model's TT chains, this works on
weights before any layer exists, for every format with spectra.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from comera.errors import ConfigError
from comera.formats.layout import Layout

__all__ = ["BudgetAllocation", "LayerSpectra", "allocate_budget", "floor_size"]


@dataclass(frozen=True)
class LayerSpectra:
    """One layer as the allocation sees it: its name, its layout (sizes of the bonds are
    ignored) and per bond (gate order) its singular values, descending."""

    name: str
    layout: Layout
    spectra: tuple[Tensor, ...]

    def __post_init__(self) -> None:
        if len(self.spectra) != len(self.layout.bonds):
            raise ConfigError(f"layer {self.name!r}: {len(self.spectra)} spectra for "
                              f"{len(self.layout.bonds)} bonds; give one per bond.")


@dataclass(frozen=True)
class BudgetAllocation:
    """Bond sizes (gate order) per layer, the cores' parameters at them, the budget, and per
    layer the estimated relative error (root of the discarded share of its energy)."""

    ranks: dict[str, tuple[int, ...]]
    size: int
    budget: float
    errors: dict[str, float]

    def __str__(self) -> str:
        rows = [f"{name}: {list(r)} (error ~{self.errors[name]:.3f})"
                for name, r in self.ranks.items()]
        return "\n".join([f"{self.size:,} of {self.budget:,.0f} parameters", *rows])


def floor_size(layers: Sequence[LayerSpectra]) -> int:
    """Parameters of the layers' cores with every bond at one slice: the least any allocation
    spends."""
    return sum(s.layout.parameters_at((1,) * len(s.layout.bonds)) for s in layers)


def allocate_budget(layers: Sequence[LayerSpectra], budget: float) -> BudgetAllocation:
    """The bond sizes of ``layers`` whose cores hold at most ``budget`` parameters and keep the
    most energy per parameter (see the module docstring). A budget below :func:`floor_size` is
    a :class:`ConfigError` naming the least budget that fits."""
    if not layers:
        raise ConfigError("no layers to allocate a budget over.")
    names = [s.name for s in layers]
    if len(set(names)) != len(names):
        raise ConfigError(f"layer names repeat in {names}; give each layer its own name.")
    if not (isinstance(budget, int | float) and math.isfinite(budget) and budget > 0):
        raise ConfigError(f"budget={budget!r}; give a number of parameters > 0.")
    floor = floor_size(layers)
    if floor > budget:
        raise ConfigError(f"a budget of {budget:,.0f} parameters cannot be met: the "
                          f"{len(layers)} layers need {floor:,} with every bond at rank 1. "
                          "Raise the budget (a lower target_compression), or convert fewer "
                          "layers.")
    shares = []  # per layer, per bond: each slice's share of the layer's energy (floats)
    for s in layers:
        energy = [[float(v) ** 2 for v in spectrum] for spectrum in s.spectra]
        # every unfolding of one tensor holds its whole energy; a bond's own total also holds
        # when a format reads different bonds from differently whitened weights
        shares.append([[v / sum(e) if sum(e) > 0 else 0.0 for v in e] for e in energy])
    sizes = [[1] * len(s.layout.bonds) for s in layers]
    # each layer's squared relative error bound: the shares its bonds discard
    left = [sum(sum(bond[1:]) for bond in share) for share in shares]
    own = [s.layout.parameters_at(r) for s, r in zip(layers, sizes, strict=True)]
    limits = [s.layout.in_features * s.layout.out_features for s in layers]
    versions = [0] * len(layers)
    size = floor
    heap: list[tuple[float, int, int, int, int]] = []

    def push(i: int) -> None:
        layout = layers[i].layout
        costs = layout.slice_costs(sizes[i])
        caps = layout.bond_caps(sizes[i])
        for b, (cost, cap) in enumerate(zip(costs, caps, strict=True)):
            r = sizes[i][b]
            if (r >= len(shares[i][b]) or (cap is not None and r >= cap)
                    or own[i] + cost > limits[i]):
                continue
            share = shares[i][b][r]
            gain = left[i] ** 2 - max(left[i] - share, 0.0) ** 2
            # the most gain per parameter first; ties: earlier layer, earlier bond
            heapq.heappush(heap, (-gain / cost, i, b, versions[i], cost))

    for i in range(len(layers)):
        push(i)
    while heap:
        _, i, b, version, cost = heapq.heappop(heap)
        if version != versions[i] or size + cost > budget:
            continue  # stale (the layer changed since), or it no longer fits (it never will)
        left[i] -= shares[i][b][sizes[i][b]]
        sizes[i][b] += 1
        size += cost
        own[i] += cost
        versions[i] += 1
        push(i)
    ranks = {s.name: tuple(r) for s, r in zip(layers, sizes, strict=True)}
    errors = {}
    for s, r, share in zip(layers, sizes, shares, strict=True):
        discarded = sum(sum(bond[k:]) for bond, k in zip(share, r, strict=True))
        errors[s.name] = math.sqrt(min(max(discarded, 0.0), 1.0))
    return BudgetAllocation(ranks, size, float(budget), errors)
