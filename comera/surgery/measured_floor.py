"""``floor="measured"``: the global allocation kept only where the converted model's loss says so.

The global spend (:func:`comera.ranks.global_budget.allocate_budget`) ranks bond slices by a
truncation-error estimate, a bound on each layer's error and not the model's loss; at high
compression it can choose ranks under which the model does worse than under the uniform ones.
With ``ConvertConfig(allocation="global", floor="measured")`` ``convert_`` decomposes the
linear layers at both candidates, the uniform allocation's bonds and the global spend's own
(both calibrated, both refitted when ``closed_form_refit`` is set), swaps each into the model in
turn, measures its loss on the measurement batches (:func:`comera.surgery.measured_loss.model_loss`)
and keeps the lower, for the whole model; a tie keeps uniform's.

Cost: two decompositions of every linear layer instead of one (one when both candidates give
every layer the same bonds), ``(1 + candidates) x len(batches)`` forward passes without
gradients (the dense model's loss, then each candidate's), and a copy of the uniform
candidate's cores (the compressed size) while the global one is measured. Between
measurements the original modules are swapped back, so an error leaves the model as it was.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

from comera.surgery.config import ConvertConfig
from comera.surgery.converters import Part
from comera.surgery.decompose import candidate_ranks, check_linear, decompose_parts_
from comera.surgery.input_statistics import InputStats
from comera.surgery.measured_loss import LossFn, model_loss
from comera.surgery.swap import fast_paths_off_, swap_submodule

__all__ = ["MeasuredFloor", "keep_lower_", "measured_floor_", "swapped_in"]


@dataclass(frozen=True)
class MeasuredFloor:
    """Which ranks ``floor="measured"`` kept (the allocation's name, ``"global"`` or
    ``"sensitivity"``, or ``"uniform"``), the bonds per layer, and the loss on the measurement
    batches of the candidates measured (``"uniform"`` and the allocation's: equal when both gave
    the same bonds, measured once)."""

    kept: str
    bonds: dict[str, tuple[int, ...]]
    losses: dict[str, float]


@contextmanager
def swapped_in(model: nn.Module, built: Sequence[tuple[str, nn.Module]]) -> Iterator[None]:
    """``model`` with the ``built`` (name, module) pairs swapped in (torch's transformer fast
    paths off where they would read a replaced dense weight), and as it was on exit."""
    old = [(name, swap_submodule(model, name, layer)) for name, layer in built]
    flags = [(m, "activation_relu_or_gelu", m.activation_relu_or_gelu) for m in model.modules()
             if isinstance(m, nn.TransformerEncoderLayer)]
    flags += [(m, "use_nested_tensor", m.use_nested_tensor) for m in model.modules()
              if isinstance(m, nn.TransformerEncoder)]
    try:
        fast_paths_off_(model)
        yield
    finally:
        for module, attr, value in flags:
            setattr(module, attr, value)
        for name, module in reversed(old):
            swap_submodule(model, name, module)


def measured_floor_(model: nn.Module, built: Sequence[tuple[str, nn.Module]],
                    parts: Sequence[Part], stats: Mapping[str, InputStats],
                    config: ConvertConfig, batches: Sequence,
                    loss: LossFn | None = None) -> MeasuredFloor:
    """Decompose ``parts`` at the uniform and the global candidate in turn, measure the model's
    loss on ``batches`` with ``built`` swapped in under each, and leave the parts' layers at the
    one of lower loss (see the module docstring). ``model`` is unchanged on return."""
    linear = check_linear(parts, config)
    allocation, uniform = candidate_ranks(linear, stats, config)
    return keep_lower_(model, built, parts, stats, config, batches, loss,
                       uniform, ("global", allocation.ranks))


def keep_lower_(model: nn.Module, built: Sequence[tuple[str, nn.Module]],
                parts: Sequence[Part], stats: Mapping[str, InputStats], config: ConvertConfig,
                batches: Sequence, loss: LossFn | None,
                uniform: Mapping[str, Sequence[int]],
                other: tuple[str, Mapping[str, Sequence[int]]]) -> MeasuredFloor:
    """The measured floor of any allocation: decompose the linear ``parts`` at the ``uniform``
    bonds and at ``other`` (its name and bonds) in turn, measure the model's loss on
    ``batches`` with ``built`` swapped in under each (once when both give every layer the same
    bonds), and leave the parts' layers at the lower; a tie keeps uniform's."""
    linear = check_linear(parts, config)
    name, bonds = other
    candidates = {"uniform": uniform, name: bonds}
    same = all(tuple(uniform[p.name]) == tuple(bonds[p.name]) for p in linear)
    losses: dict[str, float] = {}
    saved = None
    for which in ("uniform",) if same else ("uniform", name):
        decompose_parts_(parts, stats, config, bonds=candidates[which])
        with swapped_in(model, built):
            losses[which] = model_loss(model, batches, loss)
        if which == "uniform" and not same:
            saved = _state(linear)
    if same:
        losses[name] = losses["uniform"]
    kept = name if _lower(losses[name], losses["uniform"]) else "uniform"
    if kept == "uniform" and saved is not None:
        _restore_(linear, saved)
    return MeasuredFloor(kept, {n: tuple(b) for n, b in candidates[kept].items()}, losses)


def _lower(a: float, b: float) -> bool:
    """``a < b``, a NaN counting as infinite."""
    a, b = (math.inf if math.isnan(x) else x for x in (a, b))
    return a < b


def _state(parts: Sequence[Part]) -> dict[str, tuple[tuple[int, ...], dict]]:
    """Each part's layer: its bond sizes and a copy of its state."""
    return {p.name: (p.layer.layout.bond_sizes,
                     {k: v.detach().clone() for k, v in p.layer.state_dict().items()})
            for p in parts}


def _restore_(parts: Sequence[Part], saved: Mapping[str, tuple[tuple[int, ...], dict]]) -> None:
    """Each part's layer back at the bond sizes and state of :func:`_state`."""
    for p in parts:
        bonds, state = saved[p.name]
        p.layer.resize_bonds_(bonds)
        p.layer.load_state_dict(state)
