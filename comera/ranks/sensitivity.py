"""Rank allocation from measured sensitivity: per layer a few candidate ranks, each with the loss
the model had when that layer alone was decomposed at it (ASVD's sensitivity list), and one
parameter budget spent where a parameter lowers the summed loss increase the most.

The measurement is :mod:`comera.surgery.sensitivity`'s; this module only chooses, from numbers:
per layer a :class:`LayerSensitivity` (its candidates: bond sizes, parameters, measured loss),
and :func:`allocate_sensitivity` picks one candidate per layer minimising the sum over layers of
``loss(candidate) - loss(dense)`` within the budget (the additive model of the loss: each
layer's increase measured with the others dense).

**Why a greedy by marginal loss per parameter, not ASVD's threshold.** ASVD binary-searches one
loss-increase threshold and gives each layer the smallest rank under it, so a parameter of a
large layer and one of a small layer count alike; layers of one model differ in size (GPT-2's
``attn.c_attn`` holds three times the parameters of ``attn.c_proj``), and the choice is a
knapsack with one item per layer. The greedy starts every layer at its cheapest candidate and
repeatedly moves the one layer, to the higher candidate, whose move lowers the summed increase
the most per parameter it costs and still fits (any higher candidate, not only the next: a
measured ladder need not be convex). It ends when no move both fits and lowers the sum, so a
budget no candidate's loss asks for is left unspent (the model comes out smaller). Where
the uniform candidates' sum is not higher than the greedy's, the uniform ones come back
(:attr:`SensitivityAllocation.kept`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from comera.errors import ConfigError

__all__ = ["LADDER", "Candidate", "LayerSensitivity", "SensitivityAllocation",
           "allocate_sensitivity", "ladder_sizes"]

#: The candidate sizes of a layer as multiples of its uniform share (the parameters the uniform
#: allocation gives it): a geometric ladder of ratio sqrt(2) from 1/4 to 4 (capped at the
#: layer's dense size; candidates of equal bonds are measured once).
LADDER: tuple[float, ...] = tuple(2 ** (k / 2) for k in range(-4, 5))


def ladder_sizes(share: int, dense: int, ladder: Sequence[float] = LADDER) -> list[float]:
    """The parameter budgets of one layer's candidates: ``share`` times each factor of
    ``ladder``, none above ``dense`` (the layer's dense size), ascending and distinct."""
    if not (isinstance(share, int) and share >= 1 and isinstance(dense, int) and dense >= 1):
        raise ConfigError(f"share={share!r}, dense={dense!r}: both are parameter counts >= 1.")
    return sorted({min(share * f, float(dense)) for f in ladder} | {float(min(share, dense))})


@dataclass(frozen=True)
class Candidate:
    """One measured option of a layer: its bond sizes (gate order), the parameters of its cores
    there, and the model's loss with this layer alone decomposed at them."""

    bonds: tuple[int, ...]
    size: int
    loss: float


@dataclass(frozen=True)
class LayerSensitivity:
    """A layer's measured candidates (any order; sorted by size here) and which of them is the
    uniform allocation's (``uniform``: its bond sizes)."""

    name: str
    candidates: tuple[Candidate, ...]
    uniform: tuple[int, ...]

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.candidates, key=lambda c: (c.size, c.bonds)))
        if not ordered:
            raise ConfigError(f"layer {self.name!r}: no candidates; give at least one.")
        if self.uniform not in {c.bonds for c in ordered}:
            raise ConfigError(f"layer {self.name!r}: the uniform bonds {list(self.uniform)} "
                              "are not among its candidates; measure them too.")
        object.__setattr__(self, "candidates", ordered)

    def at(self, bonds: Sequence[int]) -> Candidate:
        """The candidate of these bond sizes."""
        return next(c for c in self.candidates if c.bonds == tuple(bonds))


@dataclass(frozen=True)
class SensitivityAllocation:
    """Bond sizes per layer, their cores' parameters, the budget, the summed measured loss
    increase they predict (``increase``) and the uniform candidates' (``uniform_increase``), and
    which was kept (``"sensitivity"``, or ``"uniform"`` where its sum was not higher)."""

    ranks: dict[str, tuple[int, ...]]
    size: int
    budget: float
    increase: float
    uniform_increase: float
    kept: str = "sensitivity"

    def __str__(self) -> str:
        return (f"{self.size:,} of {self.budget:,.0f} parameters; {self.kept} kept (summed loss "
                f"increase {self.increase:.4g}, uniform {self.uniform_increase:.4g})\n"
                + "\n".join(f"{n}: {list(r)}" for n, r in self.ranks.items()))


def _loss(value: float) -> float:
    """A measured loss, a NaN counting as infinite (never chosen over a finite one)."""
    return math.inf if math.isnan(value) else value


def allocate_sensitivity(layers: Sequence[LayerSensitivity], budget: float,
                         base: float = 0.0) -> SensitivityAllocation:
    """One candidate per layer whose sizes sum to at most ``budget`` and whose summed loss
    increase over ``base`` (the dense model's loss) is least by the greedy of the module
    docstring; the uniform candidates instead where their sum is not higher. A
    :class:`ConfigError` when the layers repeat a name or the cheapest candidates exceed the
    budget."""
    names = [s.name for s in layers]
    if not layers or len(set(names)) != len(names):
        raise ConfigError(f"layers {names}: give at least one, each under its own name.")
    if not (isinstance(budget, int | float) and not isinstance(budget, bool)
            and math.isfinite(budget)):
        raise ConfigError(f"budget={budget!r}; give a finite number of parameters.")
    choice = [0] * len(layers)
    size = sum(s.candidates[0].size for s in layers)
    if size > budget:
        raise ConfigError(f"a budget of {budget:,.0f} parameters cannot be met: the cheapest "
                          f"candidates of the {len(layers)} layers hold {size:,}.")
    while True:
        best = None  # (loss decrease per parameter, layer, candidate)
        for i, s in enumerate(layers):
            now = s.candidates[choice[i]]
            for j in range(choice[i] + 1, len(s.candidates)):
                c = s.candidates[j]
                cost, gain = c.size - now.size, _loss(now.loss) - _loss(c.loss)
                if size + cost > budget or not gain > 0:
                    continue
                ratio = gain / cost if cost > 0 else math.inf
                if best is None or ratio > best[0]:
                    best = (ratio, i, j)
        if best is None:
            break
        _, i, j = best
        size += layers[i].candidates[j].size - layers[i].candidates[choice[i]].size
        choice[i] = j
    ranks = {s.name: s.candidates[k].bonds for s, k in zip(layers, choice, strict=True)}
    own = sum(_loss(s.candidates[k].loss) - base for s, k in zip(layers, choice, strict=True))
    theirs = sum(_loss(s.at(s.uniform).loss) - base for s in layers)
    uniform_size = sum(s.at(s.uniform).size for s in layers)
    if not own < theirs and uniform_size <= budget:
        return SensitivityAllocation({s.name: s.uniform for s in layers}, uniform_size,
                                     float(budget), theirs, theirs, "uniform")
    return SensitivityAllocation(ranks, size, float(budget), own, theirs)

