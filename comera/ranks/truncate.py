"""Physical rank truncation: drop pruned rank slices, fold gates into cores, slice optimizer state.

During training a pruned rank is only masked (its gate entry is at or below tau), so shapes and
captured graphs stay valid. ``truncate_`` makes it physical: for every bond it keeps the slices
whose gate survives in every core that carries the bond, multiplies each gate into the first of
them (a chain's: the core on its left; then resets the gate to ones), and slices the
optimizer's per-parameter state (Adam's moments) the same way. Parameters
are replaced by new, smaller ones (autograd caches a parameter's shape, so resizing one in
place is not allowed), and the optimizer is updated to match: its param groups point at the new
parameters and their state is the old state, sliced. Hooks on the old parameters are not carried
over; a DDP wrapper must be rebuilt. The function the model computes is unchanged; the compiled
plans are re-made for the new shapes.

Rounding (``round_``, ``round_layer_``): the format's exact rounding in place, keeping the
stored shapes (TT and TT-matrix: QR sweep left to right, SVD sweep right to left; a format
without one is left as it is). A bond between two cores can carry no more than the smaller of
their other indices' products (a chain's: ``r_k <= r_{k-1} n_k`` and ``r_k <= n_{k+1} r_{k+1}``);
pruning can leave bonds above that (``excess_bonds``), whose extra slices cost parameters and
add nothing. Rounding re-expresses the same weight within those bounds and prunes the freed
slices. The late stage's pruning does it as it goes (``LateStage(rounding=True)``, see
:mod:`comera.ranks.objective`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from comera.formats.registry import Format
from comera.layers.linear import GatedLayer, bond_ranks_of, broadcast_along
from comera.ranks.size import gated_layers


@dataclass(frozen=True)
class TruncationReport:
    """Per layer, its bonds before and after."""

    layers: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]

    @property
    def changed(self) -> bool:
        """True when some layer's bonds shrank."""
        return any(before != after for _, before, after in self.layers)

    def __str__(self) -> str:
        rows = [f"{name or '<model>'}: {before} -> {after}" for name, before, after in self.layers]
        return "\n".join(rows) or "no TT layers"


def _sliced_(plist: nn.ParameterList, k: int, dim: int, keep: Tensor, optimizer) -> None:
    """Replace ``plist[k]`` by its entries ``keep`` along ``dim``; carry grad and optimizer state
    (every state tensor shaped like the parameter, e.g. Adam's two moments) along."""
    old = plist[k]
    new = nn.Parameter(old.detach().index_select(dim, keep).contiguous(),
                       requires_grad=old.requires_grad)
    if old.grad is not None:
        new.grad = old.grad.index_select(dim, keep).contiguous()
    plist[k] = new
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        group["params"] = [new if p is old else p for p in group["params"]]
    state = optimizer.state.pop(old, None)
    if state is not None:
        optimizer.state[new] = {
            key: (value.index_select(dim, keep).contiguous()
                  if isinstance(value, Tensor) and value.shape == old.shape else value)
            for key, value in state.items()
        }


def _keep_indices(mask: Tensor) -> Tensor:
    keep = torch.nonzero(mask, as_tuple=False).flatten()
    if keep.numel() == 0:  # a removed layer keeps one (masked) slice so shapes stay valid
        keep = torch.zeros(1, dtype=torch.long, device=mask.device)
    return keep


def truncate_layer_(layer: GatedLayer, optimizer=None, fold_gates: bool = True) -> None:
    """Truncate one layer in place (see the module docstring)."""
    layer.check_finite_gates()
    removed = layer.is_removed()
    masks = layer.gate_masks()
    if removed:  # the weight is exactly zero: keep one (masked) slice per bond
        masks = [torch.zeros_like(m) for m in masks]
    layout = layer.layout
    for k, (bond, mask) in enumerate(zip(layout.bonds, masks, strict=True)):
        carriers = layout.carriers(bond)
        keep = _keep_indices(mask.to(layer.cores[carriers[0][0]].device))
        for c, axis in carriers:
            _sliced_(layer.cores, c, axis, keep, optimizer)
        _sliced_(layer.gates, k, 0, keep, optimizer)
        if fold_gates and not removed:
            c, axis = carriers[0]
            with torch.no_grad():
                layer.cores[c].mul_(broadcast_along(layer.gates[k], axis, layer.cores[c].dim()))
                layer.gates[k].fill_(1.0)
    if removed:
        with torch.no_grad():
            for gate in layer.gates:
                gate.zero_()
    layer.build_compiled()


def truncate_(model: nn.Module, optimizer=None, fold_gates: bool = True) -> TruncationReport:
    """Truncate every TT layer of ``model`` (and ``optimizer``'s state) to its effective ranks.

    A gate holding a NaN or infinite entry raises :class:`~comera.errors.NonFiniteError`
    naming the layer before any layer is changed: cutting it would change the function."""
    check_finite_gates(model)
    rows = []
    for name, layer in gated_layers(model):
        before = layer.bonds
        truncate_layer_(layer, optimizer, fold_gates)
        rows.append((name, before, layer.bonds))
    rebuild_stacks(model)
    return TruncationReport(tuple(rows))


def check_finite_gates(model: nn.Module) -> None:
    """Every TT layer's gates are finite, else a :class:`~comera.errors.NonFiniteError` naming
    the first layer that is not (see :meth:`GatedLayer.check_finite_gates`).

    One test over all the gates at once; the layers are named one by one only when it fails
    (the late stage checks every step, and a test per gate costs more than the step's other
    bookkeeping)."""
    layers = list(gated_layers(model))
    gates = [g.detach().reshape(-1) for _, layer in layers for g in layer.gates]
    if not gates or bool(torch.isfinite(torch.cat(gates)).all()):
        return
    for name, layer in layers:
        layer.check_finite_gates(name)


def rebuild_stacks(model: nn.Module) -> None:
    """Rebuild the stacked networks of ``model``'s sibling layers (self-attention's q/k/v,
    :mod:`comera.layers.siblings`) after their shapes changed, so a ``torch.compile`` trace taken
    before the next eager call finds them built (inside a trace they run one by one)."""
    for module in model.modules():
        if not isinstance(module, GatedLayer) and callable(getattr(module, "build_compiled",
                                                                   None)):
            module.build_compiled()


def rounds_exactly(layer: GatedLayer | Format) -> bool:
    """True when ``layer``'s format (or the format given) has an exact rounding
    (:meth:`Format.round`)."""
    fmt = layer if isinstance(layer, Format) else layer.format
    return type(fmt).round is not Format.round


def rounded_bond_ranks(layer: GatedLayer,
                       ranks: Sequence[int] | None = None) -> tuple[int, ...]:
    """Per bond, the effective rank exact rounding leaves: each bond between two cores capped
    by the smaller of their other indices' products, repeated until no cap moves (a chain's:
    ``r_k <= r_{k-1} n_{k-1}`` and ``r_k <= n_k r_{k+1}``, as the QR and SVD sweeps leave
    them). The effective ranks as they are for a format without an exact rounding.
    ``ranks``: the layer's ``bond_ranks`` when the caller has just read them (saves reading
    the gates again)."""
    ranks = layer.bond_ranks if ranks is None else tuple(ranks)
    if not rounds_exactly(layer):
        return ranks
    while True:
        caps = layer.layout.bond_caps(ranks)
        capped = tuple(r if cap is None else min(r, cap)
                       for r, cap in zip(ranks, caps, strict=True))
        if capped == ranks:
            return ranks
        ranks = capped


def excess_bonds(layer: GatedLayer, ranks: Sequence[int] | None = None) -> list[int]:
    """Bonds (0-based gate indices) carried by two cores whose effective rank exceeds what those
    cores allow (:meth:`Layout.bond_caps`; a chain's: ``r_k > min(r_{k-1} * n_k, n_{k+1} *
    r_{k+1})``, ``n_k`` the inner size of core k). The extra slices cost parameters but add
    nothing to the weight; :func:`round_layer_` drops them exactly. ``ranks``: the layer's
    ``bond_ranks`` when the caller has just read them."""
    ranks = layer.bond_ranks if ranks is None else tuple(ranks)
    caps = layer.layout.bond_caps(ranks)
    return [k for k, (r, cap) in enumerate(zip(ranks, caps, strict=True))
            if cap is not None and r > cap]


def live_cores(layer: GatedLayer) -> list[Tensor]:
    """``layer``'s cores in float64 restricted to the live slices of each bond, each gate folded
    into the first core carrying its bond (a chain's: the core on its left): the same weight,
    as plain cores of the layout at the effective ranks (detached)."""
    layout = layer.layout
    live = [m.nonzero().flatten() for m in layer.gate_masks()]
    folds = layer.gate_folds()
    on_core: list[list[tuple[int, int]]] = [[] for _ in layer.cores]  # (axis, bond) per core
    for k, bond in enumerate(layout.bonds):
        for c, axis in layout.carriers(bond):
            on_core[c].append((axis, k))
    cores = []
    for c, core in enumerate(layer.effective_cores()):
        t = core.detach().double()
        for axis, k in sorted(on_core[c]):
            t = t.index_select(axis, live[k])
            if folds[k] == (c, axis):
                t = t * broadcast_along(layer.gates[k].detach().double()[live[k]], axis, t.dim())
        cores.append(t)
    return cores


def round_layer_(layer: GatedLayer, optimizer=None) -> bool:
    """The format's exact rounding in place, keeping the stored shapes (TT and TT-matrix: the
    live slices, gates folded in, orthogonalised left to right by QR, then cut right to left by
    SVD, dropping numerically zero singular values), so every bond ends at most at what its
    cores allow. The weight is unchanged (to float rounding); the new slices fill the first
    positions of each bond with gates of one, the rest are pruned (gate zero). Core norms are
    rebalanced to the layer's previous proportions, so no core holds the whole scale.
    ``optimizer``: the layer's cores' and gates' state (Adam's moments) no longer matches the new
    basis: first moments are zeroed, second moments set to their mean. Returns True when some
    bond shrank; False, changing nothing, for a removed layer or a format without an exact
    rounding."""
    layer.check_finite_gates()
    if layer.is_removed() or not rounds_exactly(layer):
        return False
    masks = layer.gate_masks()
    n = len(layer.cores)
    live_layout = layer.layout.resized(
        {bond: int(m.sum()) for bond, m in zip(layer.layout.bonds, masks, strict=True)})
    with torch.no_grad():
        cores = live_cores(layer)
        before = [float(c.norm()) for c in cores]
        cores = layer.format.round(cores, live_layout)
        if cores is None:
            return False
        after = [float(c.norm()) for c in cores]
        if all(b > 0 for b in before) and all(a > 0 for a in after):
            common = math.exp(sum(math.log(a / b) for a, b in zip(after, before, strict=True)) / n)
            for k in range(n):
                cores[k] = cores[k] * (common * before[k] / after[k])
        shrank = False
        for k, (core, scale) in enumerate(zip(layer.cores, layer.core_scale_values,
                                              strict=True)):
            core.zero_()
            core[tuple(slice(0, d) for d in cores[k].shape)] = (cores[k] / scale).to(core.dtype)
        for k, (gate, (c, axis)) in enumerate(zip(layer.gates, layer.gate_folds(),
                                                  strict=True)):
            rank = cores[c].shape[axis]
            shrank |= rank < int(masks[k].sum())
            gate.zero_()
            gate[:rank] = 1.0
        if optimizer is not None:
            for param in [*layer.cores, *layer.gates]:
                for key, value in optimizer.state.get(param, {}).items():
                    if isinstance(value, Tensor) and value.shape == param.shape:
                        if key == "exp_avg_sq":
                            value.fill_(float(value.mean()))
                        else:
                            value.zero_()
    return shrank


def round_(model: nn.Module, optimizer=None, only_excess: bool = True) -> TruncationReport:
    """Round the gated layers of ``model`` in place (:func:`round_layer_`): by default only
    those with a bond above what its cores allow (:func:`excess_bonds`), whose extra slices are
    then freed; the function is unchanged. Layers whose format has no exact rounding are left
    as they are. The report gives each layer's effective ranks. Non-finite gates are refused
    first, as in :func:`truncate_`."""
    check_finite_gates(model)
    rows = []
    rounded = False
    named = list(gated_layers(model))
    for (name, layer), ranks in zip(named, bond_ranks_of([m for _, m in named]), strict=True):
        # every gate read at once: 0 is a removed layer
        before = (1, *ranks, 1) if layer.layout.is_chain else ranks
        after = before
        if (0 not in ranks and rounds_exactly(layer)
                and (not only_excess or excess_bonds(layer, ranks))):
            round_layer_(layer, optimizer)
            layer.build_compiled()
            after, rounded = layer.ranks, True
        rows.append((name, before, after))
    if rounded:  # nothing changed otherwise: the sibling stacks are as they were
        rebuild_stacks(model)
    return TruncationReport(tuple(rows))
