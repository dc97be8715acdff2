"""Physical rank truncation: drop pruned rank slices, fold gates into cores, slice optimizer state.

During training a pruned rank is only masked (its gate entry is at or below tau), so shapes and
captured graphs stay valid. ``truncate_`` makes it physical: for every bond it keeps the slices
whose gate survives, multiplies each gate into the core on its left (then resets the gate to
ones), and slices the optimizer's per-parameter state (Adam's moments) the same way. Parameters
are replaced by new, smaller ones (autograd caches a parameter's shape, so resizing one in
place is not allowed), and the optimizer is updated to match: its param groups point at the new
parameters and their state is the old state, sliced. Hooks on the old parameters are not carried
over; a DDP wrapper must be rebuilt. The function the model computes is unchanged; the compiled
plans are re-made for the new shapes.

Rounding (``round_``, ``round_layer_``): TT rounding in place, keeping the stored shapes. A bond
can carry no more than its neighbours allow (``r_k <= r_{k-1} n_k`` and ``r_k <= n_{k+1}
r_{k+1}``); pruning can leave bonds above that (``excess_bonds``), whose extra slices cost
parameters and add nothing. Rounding re-expresses the same weight at those bounds (QR sweep left
to right, SVD sweep right to left) and prunes the freed slices. The late stage's pruning does it
as it goes (``LateStage(rounding=True)``, see :mod:`comera.ranks.objective`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from comera.layers.linear import GatedTrain
from comera.ranks.size import tt_modules


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


def truncate_layer_(layer: GatedTrain, optimizer=None, fold_gates: bool = True) -> None:
    """Truncate one layer in place (see the module docstring)."""
    layer.check_finite_gates()
    removed = layer.is_removed()
    masks = layer.gate_masks()
    if removed:  # the weight is exactly zero: keep one (masked) slice per bond
        masks = [torch.zeros_like(m) for m in masks]
    for k, mask in enumerate(masks):
        keep = _keep_indices(mask.to(layer.cores[k].device))
        _sliced_(layer.cores, k, layer.cores[k].dim() - 1, keep, optimizer)
        _sliced_(layer.cores, k + 1, 0, keep, optimizer)
        _sliced_(layer.gates, k, 0, keep, optimizer)
        if fold_gates and not removed:
            with torch.no_grad():
                layer.cores[k].mul_(layer.gates[k])
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
    for name, layer in tt_modules(model):
        before = layer.bonds
        truncate_layer_(layer, optimizer, fold_gates)
        rows.append((name, before, layer.bonds))
    rebuild_stacks(model)
    return TruncationReport(tuple(rows))


def check_finite_gates(model: nn.Module) -> None:
    """Every TT layer's gates are finite, else a :class:`~comera.errors.NonFiniteError` naming
    the first layer that is not (see :meth:`GatedTrain.check_finite_gates`)."""
    for name, layer in tt_modules(model):
        layer.check_finite_gates(name)


def rebuild_stacks(model: nn.Module) -> None:
    """Rebuild the stacked networks of ``model``'s sibling layers (self-attention's q/k/v,
    :mod:`comera.layers.siblings`) after their shapes changed, so a ``torch.compile`` trace taken
    before the next eager call finds them built (inside a trace they run one by one)."""
    for module in model.modules():
        if not isinstance(module, GatedTrain) and callable(getattr(module, "build_compiled",
                                                                   None)):
            module.build_compiled()


def excess_bonds(layer: GatedTrain) -> list[int]:
    """Bonds (0-based gate indices) whose effective rank exceeds what their neighbours allow:
    ``r_k > min(r_{k-1} * n_k, n_{k+1} * r_{k+1})`` (``n_k`` the inner size of core k). The
    extra slices cost parameters but add nothing to the weight; :func:`round_layer_` drops them
    exactly."""
    ranks = layer.ranks
    out = []
    for k in range(len(layer.gates)):
        left = ranks[k] * math.prod(layer.cores[k].shape[1:-1])
        right = math.prod(layer.cores[k + 1].shape[1:-1]) * ranks[k + 2]
        if ranks[k + 1] > min(left, right):
            out.append(k)
    return out


def live_cores(layer: GatedTrain) -> list[Tensor]:
    """``layer``'s cores in float64 restricted to the live slices of each bond, each gate folded
    into the core on its left: the same weight, as plain TT cores (detached)."""
    live = [None] + [m.nonzero().flatten() for m in layer.gate_masks()] + [None]
    cores = []
    for k, core in enumerate(layer.cores):
        c = core.detach().double()
        if live[k] is not None:
            c = c.index_select(0, live[k])
        if live[k + 1] is not None:
            c = c.index_select(c.dim() - 1, live[k + 1]) * layer.gates[k].detach().double()[
                live[k + 1]]
        cores.append(c)
    return cores


def round_layer_(layer: GatedTrain, optimizer=None, rtol: float = 1e-7) -> bool:
    """TT rounding in place, keeping the stored shapes: the live slices (gates folded in) are
    orthogonalised left to right (QR), then cut right to left (SVD, dropping singular values
    below ``rtol`` times the largest: numerically zero ones), so every bond ends at most at what
    its neighbours allow. The weight is unchanged (to float rounding); the new slices fill the
    first positions of each bond with gates of one, the rest are pruned (gate zero). Core norms
    are rebalanced to the layer's previous proportions, so no core holds the whole scale.
    ``optimizer``: the layer's cores' and gates' state (Adam's moments) no longer matches the new
    basis: first moments are zeroed, second moments set to their mean. Returns True when some
    bond shrank."""
    layer.check_finite_gates()
    if layer.is_removed():
        return False
    masks = layer.gate_masks()
    n = len(layer.cores)
    with torch.no_grad():
        cores = live_cores(layer)
        before = [float(c.norm()) for c in cores]
        for k in range(n - 1):  # left to right: QR
            shape = cores[k].shape
            q, r = torch.linalg.qr(cores[k].reshape(-1, shape[-1]))
            cores[k] = q.reshape(*shape[:-1], q.shape[1])
            cores[k + 1] = torch.tensordot(r, cores[k + 1], dims=1)
        for k in range(n - 1, 0, -1):  # right to left: SVD, drop numerically zero directions
            shape = cores[k].shape
            u, s, vh = torch.linalg.svd(cores[k].reshape(shape[0], -1), full_matrices=False)
            keep = max(1, int((s > rtol * s[0]).sum())) if s.numel() else 1
            cores[k] = vh[:keep].reshape(keep, *shape[1:])
            cores[k - 1] = torch.tensordot(cores[k - 1], u[:, :keep] * s[:keep], dims=1)
        after = [float(c.norm()) for c in cores]
        if all(b > 0 for b in before) and all(a > 0 for a in after):
            common = math.exp(sum(math.log(a / b) for a, b in zip(after, before, strict=True)) / n)
            for k in range(n):
                cores[k] = cores[k] * (common * before[k] / after[k])
        shrank = False
        for k, core in enumerate(layer.cores):
            rank = cores[k].shape[-1]
            core.zero_()
            core[tuple(slice(0, d) for d in cores[k].shape)] = cores[k].to(core.dtype)
            if k < len(layer.gates):
                gate = layer.gates[k]
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
    """Round the TT layers of ``model`` in place (:func:`round_layer_`): by default only those
    with a bond above what its neighbours allow (:func:`excess_bonds`), whose extra slices are
    then freed; the function is unchanged. The report gives each layer's effective ranks.
    Non-finite gates are refused first, as in :func:`truncate_`."""
    check_finite_gates(model)
    rows = []
    for name, layer in tt_modules(model):
        before = layer.ranks
        if not layer.is_removed() and (not only_excess or excess_bonds(layer)):
            round_layer_(layer, optimizer)
            layer.build_compiled()
        rows.append((name, before, layer.ranks))
    rebuild_stacks(model)
    return TruncationReport(tuple(rows))
