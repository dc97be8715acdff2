"""A per-core RMS bound: after every optimizer step, each core of each gated layer is scaled down
to at most ``factor`` times its initial root-mean-square (as Qiu et al. 2024, "Compute Better
Spent", keep BTT's cores at their initial scale in transformers).

A product of cores can grow its weight by growing every core a little; under Adam each core
moves by about the learning rate whatever its size, so the cores of a large-rate run drift above
the scale at which the product has a dense layer's variance, and the layer's output with them.
The bound is a projection onto the ball of that scale, one core at a time: a core inside it is
left as it is, one outside is scaled back onto it.

The reference scale is the balanced parametrization's (:func:`comera.formats.scaling.
core_scaling`): core k, as the network reads it (stored values times the core's multiplier), has
RMS ``std_k``, the scale at which every core is well conditioned and W has ``nn.Linear``'s
variance. It depends on the layout only, so it is the same for plain and balanced layers and for
a core initialised at zero (:func:`comera.layers.zero_init.zero_output_`). Gates are not bounded:
they scale the bonds, as the learnable scalars of that paper's normalised BTT do.

Two ways to run it: :func:`bound_core_rms_` once (after your ``optimizer.step()``), or
:func:`keep_core_rms_bounded`, a hook that runs it after each step of ``optimizer`` or, with no
optimizer (a loop that builds its own, as the engine does), before each training-mode forward of
the model, which is after the step before it.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from comera.errors import ConfigError
from comera.formats.scaling import core_scaling
from comera.layers.linear import GatedLayer

__all__ = ["bound_core_rms_", "core_rms_bounds", "keep_core_rms_bounded"]


def check_factor(factor: float) -> float:
    """``factor`` if it is a finite number > 0, else a ConfigError naming it."""
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not (
            factor > 0 and math.isfinite(factor)):
        raise ConfigError(f"factor={factor!r}; the RMS bound is a multiple of each core's "
                          "initial RMS: give a finite number > 0 (1.0: the initial scale).")
    return float(factor)


def core_rms_bounds(layer: GatedLayer, factor: float = 1.0) -> tuple[float, ...]:
    """Per stored core of ``layer``, the largest RMS the bound allows it: ``factor`` times the
    balanced initial RMS of the core as the network reads it, over the core's multiplier."""
    if not isinstance(layer, GatedLayer):
        raise ConfigError(f"core_rms_bounds: got a {type(layer).__name__}; give a gated layer.")
    factor = check_factor(factor)
    stds = core_scaling(layer.layout).stds
    return tuple(factor * std / scale
                 for std, scale in zip(stds, layer.core_scale_values, strict=True))


class _Bounds:
    """The bounds of each gated layer of a model, recomputed when a layer's layout changes
    (truncation, rounding); held weakly, so a copied model's layers get their own."""

    def __init__(self, factor: float):
        self.factor = factor
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def of(self, layer: GatedLayer) -> tuple[float, ...]:
        layout, scales = layer.layout, layer.core_scale_values
        cached = self._seen.get(layer)
        if cached is None or cached[0] is not layout or cached[1] != scales:
            cached = (layout, scales, core_rms_bounds(layer, self.factor))
            self._seen[layer] = cached
        return cached[2]

    @torch.no_grad()
    def apply_(self, module: nn.Module) -> None:
        for layer in _gated(module):
            for core, bound in zip(layer.cores, self.of(layer), strict=True):
                if core.numel() == 0:
                    continue
                rms = torch.linalg.vector_norm(core) / math.sqrt(core.numel())
                core.mul_(torch.clamp(bound / rms, max=1.0))  # rms 0: inf, clamped to 1


def _gated(module: nn.Module) -> list[GatedLayer]:
    return [m for m in module.modules() if isinstance(m, GatedLayer)]


def _check_module(module: nn.Module, what: str) -> None:
    if not isinstance(module, nn.Module):
        raise ConfigError(f"{what}: got a {type(module).__name__}; give the nn.Module whose "
                          "gated layers' cores to bound.")
    if not _gated(module):
        raise ConfigError(f"{what}: the {type(module).__name__} has no gated layers, so no "
                          "cores to bound; convert it first (comera.convert_) or drop the bound.")


def bound_core_rms_(module: nn.Module, factor: float = 1.0) -> None:
    """Scale down, in place, every core of every gated layer in ``module`` whose RMS exceeds
    its bound (:func:`core_rms_bounds`) onto the bound; the others are left as they are."""
    _check_module(module, "bound_core_rms_")
    _Bounds(check_factor(factor)).apply_(module)


def keep_core_rms_bounded(module: nn.Module, factor: float = 1.0,
                          optimizer: torch.optim.Optimizer | None = None) -> RemovableHandle:
    """Bound the cores of ``module`` (:func:`bound_core_rms_`) after each step of ``optimizer``,
    or, without one, before each forward of ``module`` in training mode. Returns the hook's
    handle (``handle.remove()`` stops it). With ``torch.compile`` of the model, pass the
    optimizer: a forward hook that writes parameters breaks the compiled graph."""
    _check_module(module, "keep_core_rms_bounded")
    bounds = _Bounds(check_factor(factor))
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer={optimizer!r}; give a torch.optim.Optimizer (or None: "
                              "bound before each training forward).")
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not any(id(c) in ids for layer in _gated(module) for c in layer.cores):
            raise ConfigError("keep_core_rms_bounded: the optimizer holds none of the module's "
                              "cores; give the optimizer that trains this module.")
        return optimizer.register_step_post_hook(lambda opt, args, kwargs: bounds.apply_(module))

    def before_forward(mod: nn.Module, args) -> None:
        if mod.training:
            bounds.apply_(mod)

    return module.register_forward_pre_hook(before_forward)
