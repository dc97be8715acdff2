"""The rank allocator: one size budget spent across many layers' bonds, slice by slice, where a
registered rule says a slice is worth the most per parameter.

Each layer comes with its layout (modes, cores, bonds) and, per bond, the singular values of its
weight unfolded at that bond (``Format.spectra`` before a layer exists, of the *whitened* weight
for a calibrated conversion; :func:`comera.ranks.allocate.bond_spectra` of a built chain).
Keeping ``r`` slices of a bond discards the energy of its singular values past ``r``, and the
decomposition's squared relative error ``e`` is at most the discarded shares of the energy
summed over bonds (TT-SVD, HOSVD; exact for one bond). Shares, not energies: layers of different
scales compare.

:func:`allocate_budget` starts every bond at one slice (or at a given start) and adds one move
at a time, the one whose gain under the **rule** is largest per parameter it costs, until none
fits the budget. The rules (:data:`RULES`, :func:`register_rule`):

- ``"squared_error"`` (``convert_``'s global allocation): lower ``sum over layers of e^2`` (a
  slice of share ``g`` in a layer at ``e`` gains ``e^2 - (e - g)^2``), each bond's shares of its
  own total. Squaring ``e`` weighs a layer's error more the larger it is, so no layer is
  starved; spending by ``sum of e`` gave a higher perplexity on the trained causal LM
  (``docs/results.md``, issue 31).
- ``"energy_share"`` (the late stage's spectrum allocation, :mod:`comera.ranks.allocate`): a
  slice gains its share of the layer's energy (the first bond's total), ``sum of e``.

A slice costs what the cores carrying its bond grow by (:meth:`Layout.slice_costs`, which
changes as the neighbouring bonds grow), a bond never exceeds what its spectrum holds or its
cores allow (:meth:`Layout.bond_caps`), and (``dense_limit``) no layer grows past its dense size
(``in x out``: beyond it the factors would hold more than the matrix they stand for). A bond held
at its cap by the other bonds of a core it shares (a Tucker core holds ``a_k <= prod_{j != k}
a_j``, so from rank 1 no single bond may grow) grows (``pairs``) together with one of them: a
move of two slices, scored by their joint gain per parameter.

**Uniform as the floor.** Given the uniform allocation's bond sizes (``uniform=``, the ranks
``allocation="uniform"`` builds at the same budget), :func:`allocate_budget` estimates both
from the same spectra (the rule's objective, :func:`estimate`) and returns the uniform ranks
wherever its own estimate is not lower (:attr:`BudgetAllocation.kept` says which): a greedy
spend can lose to uniform's (a cheap slice taken first can leave a large one no room), and the
global allocation then never does worse than uniform by its own measure.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor

from comera.errors import ConfigError
from comera.formats.layout import Layout
from comera.numbers import is_int

__all__ = ["RULES", "BudgetAllocation", "LayerSpectra", "Rule", "allocate_budget", "estimate",
           "floor_size", "get_rule", "register_rule"]


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


# -- rules ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """What a slice is worth. ``shares``: per bond, each slice's share of the layer's energy
    (from its spectra); ``gain(left, share)``: how much keeping a slice of ``share`` lowers the
    layer's objective when its bonds discard ``left``; ``objective(left)``: the layer's term of
    the quantity the allocation lowers (summed over layers: :func:`estimate`)."""

    name: str
    shares: Callable[[Sequence[Tensor]], list[list[float]]]
    gain: Callable[[float, float], float]
    objective: Callable[[float], float]


def _bond_shares(spectra: Sequence[Tensor]) -> list[list[float]]:
    """Each bond's slices as shares of that bond's own energy: every unfolding of one tensor
    holds its whole energy; a bond's own total also holds when a format reads different bonds
    from differently whitened weights."""
    energy = [[float(v) ** 2 for v in spectrum] for spectrum in spectra]
    return [[v / sum(e) if sum(e) > 0 else 0.0 for v in e] for e in energy]


def _layer_shares(spectra: Sequence[Tensor]) -> list[list[float]]:
    """Every bond's slices as shares of the first bond's energy (a chain's weight)."""
    energy = [s.square() for s in spectra]
    total = max(float(energy[0].sum()) if energy and energy[0].numel() else 0.0, 1e-300)
    return [(e / total).tolist() for e in energy]


RULES: dict[str, Rule] = {}


def register_rule(rule: Rule) -> Rule:
    """Add ``rule`` to :data:`RULES` under its name (a user's own valuation of a slice)."""
    if not isinstance(rule, Rule) or not rule.name:
        raise ConfigError(f"register_rule takes a Rule with a name, got {rule!r}.")
    RULES[rule.name] = rule
    return rule


def get_rule(name: str | Rule) -> Rule:
    """The registered rule called ``name`` (a :class:`Rule` passes through), else a
    :class:`ConfigError` naming the choices."""
    if isinstance(name, Rule):
        return name
    if not isinstance(name, str) or name not in RULES:
        raise ConfigError(f"rule={name!r}; choose one of {', '.join(RULES)}.")
    return RULES[name]


register_rule(Rule("squared_error", _bond_shares,
                   lambda left, share: left ** 2 - max(left - share, 0.0) ** 2,
                   lambda left: left ** 2))
register_rule(Rule("energy_share", _layer_shares, lambda left, share: share,
                   lambda left: left))


# -- the allocation -------------------------------------------------------------------------------
@dataclass(frozen=True)
class BudgetAllocation:
    """Bond sizes (gate order) per layer, the cores' parameters at them, the budget, and per
    layer the estimated relative error (root of the discarded share of its energy).

    ``kept``: ``"global"`` (the greedy spend's ranks) or ``"uniform"`` (the uniform ranks given
    to :func:`allocate_budget`, whose :func:`estimate` was not higher); ``estimate`` and
    ``uniform_estimate``: the two estimates (None: no uniform ranks were given)."""

    ranks: dict[str, tuple[int, ...]]
    size: int
    budget: float
    errors: dict[str, float]
    kept: str = "global"
    estimate: float = 0.0
    uniform_estimate: float | None = None

    def __str__(self) -> str:
        rows = [f"{name}: {list(r)} (error ~{self.errors[name]:.3f})"
                for name, r in self.ranks.items()]
        head = f"{self.size:,} of {self.budget:,.0f} parameters"
        if self.uniform_estimate is not None:
            head += (f"; {self.kept} ranks kept (estimate {self.estimate:.4g}, uniform "
                     f"{self.uniform_estimate:.4g})")
        return "\n".join([head, *rows])


def floor_size(layers: Sequence[LayerSpectra]) -> int:
    """Parameters of the layers' cores with every bond at one slice: the least any allocation
    from rank 1 spends."""
    return sum(s.layout.parameters_at((1,) * len(s.layout.bonds)) for s in layers)


def _discarded(shares: list[list[float]], sizes: Sequence[int]) -> float:
    """The shares a layer's bonds at ``sizes`` discard, summed over bonds (its squared relative
    error bound)."""
    return sum(sum(bond[k:]) for bond, k in zip(shares, sizes, strict=True))


def estimate(layers: Sequence[LayerSpectra], ranks: Mapping[str, Sequence[int]],
             rule: str | Rule = "squared_error") -> float:
    """What :func:`allocate_budget` lowers under ``rule``, at bond sizes ``ranks`` (per layer
    name): the sum over layers of the rule's objective of the shares their bonds discard."""
    rule = get_rule(rule)
    return sum(rule.objective(_discarded(rule.shares(s.spectra), ranks[s.name])) for s in layers)


def _check_sizes(layers: Sequence[LayerSpectra], sizes: Mapping[str, Sequence[int]],
                 what: str) -> dict[str, tuple[int, ...]]:
    out = {}
    for s in layers:
        got = tuple(sizes.get(s.name, ()))
        if len(got) != len(s.layout.bonds) or any(
                not is_int(r) for r in got):
            raise ConfigError(f"{what} ranks for layer {s.name!r}: {list(got)}; give one int "
                              f">= 1 per bond ({len(s.layout.bonds)}).")
        out[s.name] = got
    return out


class _Greedy:
    """The greedy spend of :func:`allocate_budget`: bond sizes per layer, grown one move (one
    slice, or two where a cap holds a bond) at a time."""

    def __init__(self, layers: Sequence[LayerSpectra], shares: list[list[list[float]]],
                 start: list[list[int]], rule: Rule, pairs: bool, dense_limit: bool):
        self.layers, self.shares, self.rule, self.pairs = layers, shares, rule, pairs
        self.sizes = start
        self.left = [_discarded(share, r) for share, r in zip(shares, self.sizes, strict=True)]
        self.own = [s.layout.parameters_at(r) for s, r in zip(layers, self.sizes, strict=True)]
        self.limits = [s.layout.in_features * s.layout.out_features if dense_limit else math.inf
                       for s in layers]
        self.versions = [0] * len(layers)

    def moves(self, i: int) -> list[tuple[float, int, tuple[int, ...], int]]:
        """Layer i's moves as ``(gain per parameter, first bond, bonds, cost)``: one slice of
        every bond that can grow, and for a bond at its cap, one slice of it and one of a bond
        whose growth lifts the cap."""
        layout, sizes, shares = self.layers[i].layout, self.sizes[i], self.shares[i]
        caps = layout.bond_caps(sizes)
        out = []
        for b, (r, cap) in enumerate(zip(sizes, caps, strict=True)):
            if r >= len(shares[b]):
                continue  # the spectrum holds no more
            free = cap is None or r < cap  # else: grow it with a bond that lifts the cap
            if not (free or self.pairs):
                continue
            candidates = [(b,)] if free else [(b, j) for j in self._lifting(i, b)]
            for bonds in candidates:
                move = self._score(i, bonds)
                if move is not None:
                    out.append(move)
        return out

    def _lifting(self, i: int, b: int) -> list[int]:
        """The other bonds of the cores carrying bond b that still have slices to give."""
        layout = self.layers[i].layout
        bond = layout.bonds[b]
        others = {layout.bonds.index(x) for k, _ in layout.carriers(bond)
                  for x in layout.cores[k] if x != bond and x in layout.bonds}
        return sorted(j for j in others if self.sizes[i][j] < len(self.shares[i][j]))

    def _score(self, i: int, bonds: tuple[int, ...]) -> tuple[float, int, tuple[int, ...],
                                                                int] | None:
        layout, sizes = self.layers[i].layout, self.sizes[i]
        new = list(sizes)
        for b in bonds:
            new[b] += 1
        caps = layout.bond_caps(new)
        if any(caps[b] is not None and new[b] > caps[b] for b in bonds):
            return None
        cost = layout.parameters_at(new) - self.own[i]
        if cost <= 0 or self.own[i] + cost > self.limits[i]:
            return None
        share = sum(self.shares[i][b][sizes[b]] for b in bonds)
        return self.rule.gain(self.left[i], share) / cost, bonds[0], bonds, cost

    def apply(self, i: int, bonds: tuple[int, ...], cost: int) -> None:
        for b in bonds:
            self.left[i] -= self.shares[i][b][self.sizes[i][b]]
            self.sizes[i][b] += 1
        self.own[i] += cost
        self.versions[i] += 1


def allocate_budget(layers: Sequence[LayerSpectra], budget: float,
                    uniform: Mapping[str, Sequence[int]] | None = None, *,
                    rule: str | Rule = "squared_error",
                    start: Mapping[str, Sequence[int]] | None = None, pairs: bool = True,
                    dense_limit: bool = True) -> BudgetAllocation:
    """The bond sizes of ``layers`` whose cores hold at most ``budget`` parameters and keep the
    most of what ``rule`` values per parameter (see the module docstring).

    ``start``: each layer's bond sizes to grow from (None: every bond at 1, and a budget below
    :func:`floor_size` is a :class:`ConfigError` naming the least budget that fits; a start over
    the budget comes back as it is). ``uniform``: the uniform allocation's bond sizes at this
    budget, returned instead wherever their :func:`estimate` is not higher than the spend's.
    ``pairs``: grow a bond held at its cap together with one that lifts it. ``dense_limit``: no
    layer past its dense size."""
    if not layers:
        raise ConfigError("no layers to allocate a budget over.")
    names = [s.name for s in layers]
    if len(set(names)) != len(names):
        raise ConfigError(f"layer names repeat in {names}; give each layer its own name.")
    rule = get_rule(rule)
    if not (isinstance(budget, int | float) and not isinstance(budget, bool)
            and _finite(budget) and (budget > 0 or start is not None)):
        raise ConfigError(f"budget={budget!r}; give a finite number of parameters > 0.")
    if start is None:
        floor = floor_size(layers)
        if floor > budget:
            raise ConfigError(f"a budget of {budget:,.0f} parameters cannot be met: the "
                              f"{len(layers)} layers need {floor:,} with every bond at rank 1. "
                              "Raise the budget (a lower target_compression), or convert fewer "
                              "layers.")
        sizes = [[1] * len(s.layout.bonds) for s in layers]
    else:
        given = _check_sizes(layers, start, "start")
        sizes = [list(given[s.name]) for s in layers]
    given_uniform = None if uniform is None else _check_sizes(layers, uniform, "uniform")
    if given_uniform is not None:
        held = sum(s.layout.parameters_at(given_uniform[s.name]) for s in layers)
        if held > budget:
            raise ConfigError(f"the uniform ranks hold {held:,} parameters, over the budget of "
                              f"{budget:,.0f}; give the uniform allocation at this budget.")
    shares = [rule.shares(s.spectra) for s in layers]
    greedy = _Greedy(layers, shares, sizes, rule, pairs, dense_limit)
    size = sum(greedy.own)
    heap: list[tuple[float, int, int, tuple[int, ...], int, int]] = []

    def push(i: int) -> None:
        for ratio, b, bonds, cost in greedy.moves(i):
            # the most gain per parameter first; ties: earlier layer, earlier bond
            heapq.heappush(heap, (-ratio, i, b, bonds, greedy.versions[i], cost))

    for i in range(len(layers)):
        push(i)
    while heap:
        _, i, _, bonds, version, cost = heapq.heappop(heap)
        if version != greedy.versions[i] or size + cost > budget:
            continue  # stale (the layer changed since), or it no longer fits (it never will)
        greedy.apply(i, bonds, cost)
        size += cost
        push(i)
    ranks = {s.name: tuple(r) for s, r in zip(layers, greedy.sizes, strict=True)}
    own = sum(rule.objective(_discarded(sh, ranks[s.name]))
              for s, sh in zip(layers, shares, strict=True))
    kept, theirs = "global", None
    if given_uniform is not None:
        theirs = sum(rule.objective(_discarded(sh, given_uniform[s.name]))
                     for s, sh in zip(layers, shares, strict=True))
        if not own < theirs:
            kept, ranks = "uniform", given_uniform
            size = sum(s.layout.parameters_at(given_uniform[s.name]) for s in layers)
    errors = {s.name: math.sqrt(min(max(_discarded(sh, ranks[s.name]), 0.0), 1.0))
              for s, sh in zip(layers, shares, strict=True)}
    return BudgetAllocation(ranks, size, float(budget), errors, kept, own, theirs)


def _finite(value: float) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int too large for a float
        return False
