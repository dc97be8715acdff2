"""The CoMERA objective: rank regularisers, the early stage and the late-stage controller.

Early stage: minimise ``L + lam * R`` where R is the l1 norm of the surviving gate entries,
normalised by their count (or weighted by the parameters each rank slice costs).

Late stage, toward a target size S* (and a target loss L*): each step compares the relative
loss gap ``(L - L*) / L`` with the relative size gap ``(S - S*) / S`` and weights whichever
objective is further from its target (a tie goes to the loss): the loss, or a differentiable
size surrogate (the size formula with each rank replaced by the l1 norm of its gate). Once
S <= S*, only the loss is minimised: shrinking stops at the target.

A step budget (``LateStage(..., steps=N)``) makes landing a promise instead of a hope: Adam moves
a gate by about its learning rate per step, so at lr 1e-3 carrying a gate from 1 to tau takes
~1,000 steps, and the loss/size choice alone may change nothing in 300. With a budget, the size
follows a geometric schedule from the stage's starting size S0 to S* over the first ``landing``
fraction of the budget (:meth:`LateStage.scheduled_size`); whenever the model is above the
schedule after a step, :func:`prune_to_` removes the least salient rank slices (smallest
``|gate| * |left slice| * |right slice|`` per parameter saved) until it is not. The rest of the
budget trains at S*. Each slice is removed alone, so the size ends at most one slice below S*.

Rounding (``LateStage(rounding=True)``, the default): a bond can carry no more than its
neighbours allow (``r_k <= r_{k-1} n_k`` and ``r_k <= n_{k+1} r_{k+1}``, ``n`` a core's inner
size); pruning a slice of one bond can leave its neighbour above that bound, where its extra
slices cost parameters and add nothing (the reviews frontier's ``[1, 1, 15, 1, 1]``). With
rounding, a slice's cost counts the parameters the rounding frees with it, and every layer left
with such a bond is rounded exactly (:func:`comera.ranks.truncate.round_layer_`: QR then SVD sweeps,
the weight unchanged), so the budget goes to slices that carry something. On the reviews task at
100x this is the difference between the majority class and a model that learns.

Allocation (``LateStage(allocation="spectrum")``; the default is ``"prune"``, the schedule,
since on the reviews and language-model frontiers neither beat the other by more than the seeds'
spread: docs/results.md): instead of pruning along the schedule, the stage decides the shape when
it starts: every bond's singular values, and the
budget spent on the slices of most energy per parameter across all layers, from the uniform
allocation up (:mod:`comera.ranks.allocate`). The trainer calls :meth:`LateStage.allocate_`
before truncating; the stage then trains that shape.
Targets against the dense model: :meth:`LateStage.for_compression`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from comera.errors import ConfigError
from comera.layers.linear import bond_ranks_of
from comera.lean.readback import read_lists
from comera.ranks.allocate import FLOORS, Allocation, allocate_
from comera.ranks.budget import size_target
from comera.ranks.size import gated_layers, model_size
from comera.ranks.truncate import round_, rounded_bond_ranks

REGULARIZERS = ("l1", "size_weighted")
ALLOCATIONS = ("spectrum", "prune")


def _slice_costs(module) -> list[Tensor]:
    """Per gate, the parameters one rank slice of that bond costs in the cores carrying it
    (at the effective ranks)."""
    return [torch.tensor(float(cost))
            for cost in module.layout.slice_costs(module.bond_ranks)]


def rank_regularizer(model: nn.Module, kind: str = "l1") -> Tensor:
    """R(model): normalised l1 of the surviving gate entries (or size-weighted l1)."""
    if kind not in REGULARIZERS:
        raise ConfigError(f"regularizer {kind!r}; choose one of {', '.join(REGULARIZERS)}.")
    total: Tensor | None = None
    norm = 0.0
    for _, module in gated_layers(model):
        gates = module.effective_gates()
        weights = _slice_costs(module) if kind == "size_weighted" else [None] * len(gates)
        for gate, w in zip(gates, weights, strict=True):
            term = gate.abs().sum()
            count = gate.numel()
            if w is not None:
                term, count = term * w.to(gate), count * float(w)
            total = term if total is None else total + term
            norm += count
    if total is None:
        raise ConfigError("the model has no TT layers: convert it with comera.convert_ first.")
    return total / max(norm, 1.0)


def soft_size(model: nn.Module) -> Tensor:
    """The size formula with each bond's rank replaced by the l1 norm of its gate (each core's
    size with every bond axis counted as its gate's l1, :meth:`Layout.core_sizes_with`)."""
    total: Tensor | float | None = None
    for _, module in gated_layers(model):
        soft = [g.abs().sum() for g in module.effective_gates()]
        for term in module.layout.core_sizes_with(soft):  # the layout's one size formula
            term = term if isinstance(term, Tensor) else float(term)
            total = term if total is None else total + term
    if total is None:
        raise ConfigError("the model has no TT layers: convert it with comera.convert_ first.")
    return torch.as_tensor(total) if not isinstance(total, Tensor) else total


@dataclass(frozen=True)
class LateStage:
    """Targets of the late stage: ``target_size`` S* in parameters, ``target_loss`` L*.

    ``steps``: the step budget. With it the trainer lands on S* (within one rank slice) after
    ``landing * steps`` steps, whatever the learning rates (see the module docstring). Without
    it (None) only the loss/size objective moves the gates, at the optimizer's pace: the trainer
    then warns when it starts and reports ``behind`` in every step's stats while above S*.
    ``rounding``: pruning rounds away the slices a pruned neighbour leaves useless (see the
    module docstring); False prunes slices alone, as before.
    ``allocation``: ``"prune"`` (default) shrinks along the step budget's schedule by saliency
    pruning (every format); ``"spectrum"`` (tensor-train chains only) fixes the shape when the
    stage starts
    (:meth:`allocate_`: the budget spent on the slices of most singular-value energy per
    parameter, across all layers, from ``floor``'s allocation up; :mod:`comera.ranks.allocate`),
    so the stage trains its final shape throughout.
    """

    target_size: float
    target_loss: float = 0.0
    size_weight: float = 1.0
    steps: int | None = None
    landing: float = 0.75
    rounding: bool = True
    allocation: str = "prune"
    floor: str = "uniform"

    def __post_init__(self) -> None:
        if not self.target_size > 0:
            raise ConfigError(f"target_size={self.target_size}; it must be > 0 parameters.")
        if self.target_loss < 0:
            raise ConfigError(f"target_loss={self.target_loss}; a loss target is >= 0.")
        if self.steps is not None and (isinstance(self.steps, bool) or self.steps < 1):
            raise ConfigError(f"steps={self.steps!r}; the late stage's step budget is an int "
                              ">= 1 (or None: no schedule).")
        if not isinstance(self.rounding, bool):
            raise ConfigError(f"rounding={self.rounding!r}; pass True or False.")
        if self.allocation not in ALLOCATIONS:
            raise ConfigError(f"allocation={self.allocation!r}; choose one of "
                              f"{', '.join(ALLOCATIONS)}.")
        if self.floor not in FLOORS:
            raise ConfigError(f"floor={self.floor!r}; choose one of {', '.join(FLOORS)}.")
        if not 0 < self.landing <= 1:
            raise ConfigError(f"landing={self.landing}; the fraction of the budget spent "
                              "shrinking is in (0, 1].")

    @classmethod
    def from_ratio(cls, model: nn.Module, ratio: float, target_loss: float = 0.0,
                   size_weight: float = 1.0, dense_reference: int | None = None,
                   steps: int | None = None, landing: float = 0.75,
                   rounding: bool = True, allocation: str = "prune",
                   floor: str = "uniform") -> LateStage:
        """S* = reference / ratio, the reference being ``dense_reference`` (a parameter count)
        or, by default, the model's effective size now (shrink the whole model by ``ratio``
        from the start of the stage). For a ratio against the dense model, of chosen layers,
        see :meth:`for_compression`."""
        if not ratio > 1:
            raise ConfigError(f"target compression {ratio}; it must be > 1 (a ratio of sizes).")
        reference = dense_reference if dense_reference is not None else model_size(model)
        return cls(reference / ratio, target_loss, size_weight, steps, landing, rounding,
                   allocation, floor)

    @classmethod
    def for_compression(cls, model: nn.Module, ratio: float, of=None, target_loss: float = 0.0,
                        steps: int | None = None, **options) -> LateStage:
        """The target that compresses the layers ``of`` by ``ratio`` against their dense size
        (``dense parameters of those layers / their parameters = ratio``, a hot-row cache
        counted with its table), every other parameter kept as it is now
        (:func:`comera.ranks.budget.size_target`). ``of``: a layer type or tuple of types (e.g.
        ``comera.TTLinear``), or qualified module names (a str or a list; a name also takes the
        TT layers under it); default every TT layer. ``options``: the other fields
        (``size_weight``, ``landing``, ``rounding``, ``allocation``, ``floor``). The one way to
        build a late stage against dense: ``comera.late_stage_for`` and the engine call it."""
        return cls(size_target(model, ratio, of), target_loss, steps=steps, **options)

    def allocate_(self, model: nn.Module, optimizer=None,
                  min_rank: int = 1) -> Allocation | None:
        """At the start of the stage, with ``allocation="spectrum"``: fix the shape now
        (:func:`comera.ranks.allocate.allocate_`; the weight is rounded and the slices of least
        energy are gated off, the optimizer's moments of each layer reset; no bond below
        ``min_rank``, the trainer's floor). None otherwise, or when the model already fits
        S*."""
        if self.allocation != "spectrum" or model_size(model) <= self.target_size:
            return None
        return allocate_(model, self.target_size, optimizer, self.floor, min_rank)

    def scheduled_size(self, start_size: float, step: int) -> float:
        """The size to be at after ``step`` steps of the stage (0-based; S* without a budget):
        geometric from ``start_size`` to S* over ``landing * steps`` steps, then S*."""
        if self.steps is None or start_size <= self.target_size:
            return self.target_size
        span = max(1, math.floor(self.landing * self.steps))
        t = min(1.0, (step + 1) / span)
        return start_size * (self.target_size / start_size) ** t

    def choose(self, loss: float, size: float) -> str:
        """'loss' or 'size': which objective this step weights (see the module docstring)."""
        if size <= self.target_size:
            return "loss"
        loss_gap = (loss - self.target_loss) / max(abs(loss), 1e-12)
        size_gap = (size - self.target_size) / size
        return "size" if size_gap > loss_gap else "loss"

    def objective(self, model: nn.Module, loss: Tensor, size_reference: float | None = None,
                  decision_loss: float | None = None,
                  size: float | None = None) -> tuple[Tensor, str]:
        """The scalar to minimise this step and which term it weighted.

        ``decision_loss`` is the loss the choice is made on (default: ``loss``); data-parallel
        workers pass the loss averaged over all workers, so every worker chooses alike.
        ``size``: the model's size now (``model_size(model)``) when the caller knows it, as a
        controller does from its last step; counted here otherwise.
        """
        if size is None:
            size = model_size(model)
        seen = float(loss.detach()) if decision_loss is None else float(decision_loss)
        which = self.choose(seen, float(size))
        if which == "loss":
            return loss, which
        reference = size_reference if size_reference is not None else max(size, 1)
        return loss + self.size_weight * soft_size(model) / reference, which


def floor_size(model: nn.Module, min_rank: int) -> int:
    """The smallest size pruning may reach: every bond at ``min(min_rank, its rank now)``."""
    total = 0
    for _, layer in gated_layers(model):
        if layer.is_removed():
            total += layer.num_parameters()
            continue
        ranks = [min(min_rank, r) for r in layer.bond_ranks]
        total += layer.layout.parameters_at(ranks)
        total += layer.bias.numel() if layer.bias is not None else 0
    return total + model_size(model) - sum(m.num_parameters() for _, m in gated_layers(model))


def _slice_norms(core: Tensor, axis: int) -> Tensor:
    """The norm of each slice of ``core`` along ``axis``: (core.shape[axis],)."""
    if axis == core.dim() - 1:
        return core.reshape(-1, core.shape[-1]).norm(dim=0)
    if axis == 0:
        return core.reshape(core.shape[0], -1).norm(dim=1)
    return core.movedim(axis, 0).reshape(core.shape[axis], -1).norm(dim=1)


def _saliency(layer, k: int) -> Tensor:
    """Per entry of gate k: ``|d_i|`` times the norm of slice i in every core carrying bond k
    (a chain's: ``|d_i| * |G_k[..., i]| * |G_{k+1}[i, ...]|``), detached."""
    score = layer.gates[k].detach().abs()
    for c, axis in layer.layout.carriers(layer.layout.bonds[k]):
        score = score * _slice_norms(layer.cores[c].detach(), axis) * layer.core_scale_values[c]
    return score


def rounded_ranks(layer) -> tuple[int, ...]:
    """The effective ranks exact rounding leaves, as ``layer.ranks`` states them (a chain's
    with its ends): :func:`comera.ranks.truncate.rounded_bond_ranks`."""
    ranks = rounded_bond_ranks(layer)
    return (1, *ranks, 1) if layer.layout.is_chain else ranks


def _round_excess_(model: nn.Module, optimizer) -> None:
    round_(model, optimizer)


def prune_to_(model: nn.Module, size_limit: float, min_rank: int = 1,
              lower: float | None = None, rounding: bool = False,
              optimizer=None) -> list[tuple[Tensor, int]]:
    """Zero the least salient live gate entries, one rank slice at a time, until
    ``model_size(model) <= size_limit`` or every bond is at ``min_rank``.

    The order is saliency (see :func:`_saliency`) per parameter the slice costs, over all TT
    layers at once. ``lower``: a first pass skips a slice whose removal would take the size
    below it (a cheaper, less precise slice is taken instead); only if that pass cannot reach
    the limit does a second pass take slices in plain order. Returns the (gate, index) pairs it
    zeroed; the caller clears their optimizer moments.

    ``rounding``: layers whose bonds exceed what their neighbours allow are rounded first and
    last (:func:`comera.ranks.truncate.round_layer_`, exact; ``optimizer``'s state for their cores
    and gates is reset), and a slice's cost counts what the rounding frees with it: a slice that
    frees nothing is not taken.
    """
    if rounding:
        _round_excess_(model, optimizer)
    pruned, size = _prune_pass_(model, size_limit, min_rank, lower, rounding)
    if lower is not None and size > size_limit:
        more, _ = _prune_pass_(model, size_limit, min_rank, -math.inf, rounding)
        pruned += more
    if rounding and pruned:  # nothing changed since the first rounding when nothing was pruned
        _round_excess_(model, optimizer)
    return pruned


def _size_at(layer, ranks: Sequence[int], rounding: bool) -> int:
    """Effective parameters of ``layer`` with its bonds at ``ranks`` (its size after exact
    rounding when ``rounding``; a removed layer's bias alone), from ranks already read."""
    if rounding and 0 not in ranks:
        ranks = rounded_bond_ranks(layer, ranks)
    return layer.parameters_at_ranks(ranks)


def _model_size(model: nn.Module, rounding: bool) -> float:
    """The model's size, its gated layers at the ranks rounding leaves (``rounding``); the
    gates are read once."""
    size = model_size(model)
    if not rounding:
        return size
    layers = [layer for _, layer in gated_layers(model)]
    for layer, ranks in zip(layers, bond_ranks_of(layers), strict=True):
        size += _size_at(layer, ranks, True) - layer.parameters_at_ranks(ranks)
    return size


class _Gates:
    """The gates a pruning pass works on, read back once: which entries of each gate are
    alive and the ranks of its layer, kept up to date in Python as the pass zeroes entries (a
    read per entry taken was a device sync per entry on a GPU)."""

    def __init__(self, layers: list, ranks: list[tuple[int, ...]]) -> None:
        """``ranks``: each layer's ``bond_ranks``, already read."""
        gates = [(layer, k, g) for layer in layers for k, g in enumerate(layer.gates)]
        # the live test on the device, as everywhere else (``|g| > tau`` in the gate's dtype)
        flags = read_lists([(g.detach().abs() > layer.tau).reshape(-1) for layer, _, g in gates])
        self.flags = {id(g): f for (_, _, g), f in zip(gates, flags, strict=True)}
        self.ranks = {id(layer): list(r) for layer, r in zip(layers, ranks, strict=True)}
        self.index = {id(g): k for _, k, g in gates}

    def alive(self, gate, i: int) -> bool:
        return self.flags[id(gate)][i]  # a NaN is never a candidate

    def live(self, gate) -> int:
        return sum(self.flags[id(gate)])

    def change(self, layer, gate, rounding: bool) -> int:
        """The layer's size change if one more entry of ``gate`` were zeroed."""
        ranks = self.ranks[id(layer)]
        fewer = list(ranks)
        fewer[self.index[id(gate)]] -= 1
        return _size_at(layer, fewer, rounding) - _size_at(layer, ranks, rounding)

    def zero_(self, layer, gate, i: int) -> None:
        gate[i] = 0.0
        self.flags[id(gate)][i] = False
        self.ranks[id(layer)][self.index[id(gate)]] -= 1


def _prune_pass_(model: nn.Module, size_limit: float, min_rank: int, lower: float | None,
                 rounding: bool = False) -> tuple[list[tuple[Tensor, int]], float]:
    """One pass of :func:`prune_to_`: the (gate, index) pairs it zeroed, and the size it left
    (NaN after the closing single slice of the last pass, which nothing reads)."""
    size = _model_size(model, rounding)
    if size <= size_limit:
        return [], size
    layers = [m for _, m in gated_layers(model)]
    kept = [(m, r) for m, r in zip(layers, bond_ranks_of(layers), strict=True) if 0 not in r]
    layers = [m for m, _ in kept]
    state = _Gates(layers, [r for _, r in kept])
    scores = []
    for layer in layers:
        costs = layer.layout.slice_costs(tuple(state.ranks[id(layer)]))
        scores += [_saliency(layer, k) / max(costs[k], 1) for k in range(len(layer.gates))]
    scores = iter(read_lists(scores))
    candidates = []
    for layer in layers:
        for gate, score in zip(layer.gates, scores, strict=False):
            candidates += [(score[i], id(gate), i, layer, gate)
                           for i in range(gate.numel()) if state.alive(gate, i)]
    candidates.sort(key=lambda c: (c[0], c[1], c[2]))
    pruned = []
    with torch.no_grad():
        for _, _, i, layer, gate in candidates:
            if size <= size_limit:
                break
            if state.live(gate) <= min_rank:
                continue
            change = state.change(layer, gate, rounding)
            if rounding and change == 0:
                continue  # a slice the rounding drops anyway: removing it saves nothing
            if lower is not None and size + change < lower:
                continue  # too coarse a step this close to the limit
            if lower == -math.inf and size + change <= size_limit:
                # the last slice: take the one landing closest below the limit
                return pruned + _closest_landing_(candidates, state, size, size_limit,
                                                  min_rank, rounding), math.nan
            state.zero_(layer, gate, i)
            size += change
            pruned.append((gate, i))
    return pruned, size


def _closest_landing_(candidates, state: _Gates, size: float, size_limit: float,
                      min_rank: int, rounding: bool = False) -> list[tuple[Tensor, int]]:
    """Zero the one live entry whose removal leaves the largest size at or below the limit."""
    best = None
    for _, _, i, layer, gate in candidates:
        if not state.alive(gate, i) or state.live(gate) <= min_rank:
            continue
        after = size + state.change(layer, gate, rounding)
        if after <= size_limit and (best is None or after > best[0]):
            best = (after, layer, gate, i)
    if best is None:
        return []
    _, layer, gate, i = best
    with torch.no_grad():
        state.zero_(layer, gate, i)
    return [(gate, i)]
