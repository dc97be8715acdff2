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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from comera.layers import GatedTrain
from comera.size import tt_modules


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
    """Truncate every TT layer of ``model`` (and ``optimizer``'s state) to its effective ranks."""
    rows = []
    for name, layer in tt_modules(model):
        before = layer.bonds
        truncate_layer_(layer, optimizer, fold_gates)
        rows.append((name, before, layer.bonds))
    return TruncationReport(tuple(rows))
