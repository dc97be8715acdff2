"""How far one optimizer step moves each weight and each core, relative to its size.

A compressed layer trains like dense when its product weight W moves by about what a dense
layer's weight moves under the same optimizer and learning rate, and no core of the product
moves much faster or slower than the others (the fastest core then sets the usable learning
rate, the slowest barely learns). :func:`relative_updates` measures both around one step::

    loss.backward()
    updates = comera.relative_updates(model, optimizer.step)
    print(updates)          # per layer: ||dW|| / ||W|| and ||dG_k|| / ||G_k|| per core

Dense ``nn.Linear`` layers are measured too (their weight is their only "core"), so a
converted model and its dense original can be compared step for step. Inside a training loop
you do not own (HuggingFace ``Trainer``, Lightning, the engine), :class:`RelativeUpdateLog` measures
every k-th optimizer step through torch's global optimizer step hooks::

    with comera.RelativeUpdateLog(model, every=10) as log:
        trainer.train()
    log.steps          # [(step, RelativeUpdates), ...]

The names before 0.2.0 (``update_sizes``, ``UpdateSizes``, ``UpdateSizeLog``: "size" means a
parameter count everywhere else) still work, with a DeprecationWarning, until 0.3.0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from comera.errors import ConfigError
from comera.layers.linear import GatedLayer
from comera.numbers import is_int
from tncomp.extend import renamed

__all__ = ["LayerUpdate", "RelativeUpdateLog", "RelativeUpdates", "relative_updates"]

#: The names before 0.2.0, served with a DeprecationWarning until 0.3.0.
__getattr__ = renamed(__name__, {
    "update_sizes": (f"{__name__}:relative_updates", "0.3.0"),
    "UpdateSizes": (f"{__name__}:RelativeUpdates", "0.3.0"),
    "UpdateSizeLog": (f"{__name__}:RelativeUpdateLog", "0.3.0"),
})


@dataclass(frozen=True)
class LayerUpdate:
    """One layer's step: the relative change of its weight and of each of its cores."""

    kind: str  # the layer's format, or "dense"
    weight: float  # ||W_after - W_before|| / ||W_before|| (Frobenius)
    cores: tuple[float, ...]  # the same per core (a dense layer: its weight)

    @property
    def imbalance(self) -> float:
        """Largest over smallest per-core relative update (1.0: every core moves alike)."""
        low = min(self.cores)
        return float("inf") if low == 0 else max(self.cores) / low


@dataclass(frozen=True)
class RelativeUpdates:
    """Every measured layer's :class:`LayerUpdate`, by qualified name."""

    layers: dict[str, LayerUpdate]

    def __str__(self) -> str:
        rows = [f"{'layer':<32} {'kind':<8} {'|dW|/|W|':>9}  per core |dG|/|G|"]
        for name, u in self.layers.items():
            cores = " ".join(f"{c:.2e}" for c in u.cores)
            rows.append(f"{name:<32} {u.kind:<8} {u.weight:9.2e}  {cores}")
        return "\n".join(rows)


def _measured(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, GatedLayer | nn.Linear) and not isinstance(m, nn.Embedding)]


def _snapshot(module: nn.Module) -> tuple[Tensor, list[Tensor]]:
    with torch.no_grad():
        if isinstance(module, GatedLayer):
            return (module.to_dense().detach().double().clone(),
                    [c.detach().double().clone() for c in module.cores])
        w = module.weight.detach().double().clone()
        return w, [w]


def _relative(after: Tensor, before: Tensor) -> float:
    norm = float(before.norm())
    return float((after - before).norm()) / norm if norm > 0 else float("inf")


def relative_updates(model: nn.Module, step: Callable[[], object]) -> RelativeUpdates:
    """Run ``step()`` (e.g. ``optimizer.step``) and return how far it moved every gated layer's
    weight and cores, and every ``nn.Linear`` weight, relative to their size before the step.

    Cores are compared as stored: a core's forward multiplier (the layer's parametrization) is
    a constant, so the relative change is the same either way. Costs one dense reconstruction
    of every gated layer before and after the step: a diagnostic, not a per-step hook."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"relative_updates takes the model (an nn.Module) first, got "
                          f"{type(model).__name__}.")
    if not callable(step):
        raise ConfigError(f"step={step!r} is not callable; pass the optimizer's step method, "
                          "e.g. relative_updates(model, optimizer.step).")
    layers = _measured(model)
    if not layers:
        raise ConfigError("the model has no gated layer and no nn.Linear to measure.")
    before = {name: _snapshot(m) for name, m in layers}
    step()
    return _compare(layers, before)


def _compare(layers: list[tuple[str, nn.Module]], before: dict) -> RelativeUpdates:
    out = {}
    for name, module in layers:
        w0, cores0 = before[name]
        w1, cores1 = _snapshot(module)
        if any(a.shape != b.shape for a, b in zip(cores0, cores1, strict=True)):
            raise ConfigError(f"layer {name} changed shape during the step (ranks truncated?); "
                              "measure a step that keeps the shapes.")
        kind = module.format.name if isinstance(module, GatedLayer) else "dense"
        out[name] = LayerUpdate(kind, _relative(w1, w0),
                                tuple(_relative(b, a) for a, b in zip(cores0, cores1,
                                                                      strict=True)))
    return RelativeUpdates(out)


class RelativeUpdateLog:
    """Measure :func:`relative_updates` of ``model`` at every ``every``-th optimizer step (the
    first included) while the context is open, whatever loop steps the optimizer: torch's
    global optimizer step hooks snapshot the layers before a measured step and compare after.
    Every optimizer's steps count (one optimizer per model is the usual case)."""

    def __init__(self, model: nn.Module, every: int = 1):
        if not isinstance(model, nn.Module):
            raise ConfigError(f"RelativeUpdateLog takes the model (an nn.Module), got "
                              f"{type(model).__name__}.")
        if not is_int(every):
            raise ConfigError(f"every={every!r}; measure every k-th step with an int k >= 1.")
        self.layers = _measured(model)
        if not self.layers:
            raise ConfigError("the model has no gated layer and no nn.Linear to measure.")
        self.every = every
        self.steps: list[tuple[int, RelativeUpdates]] = []
        self._count = 0
        self._before: dict | None = None
        self._handles: list = []

    def _pre(self, optimizer, args, kwargs) -> None:
        if self._count % self.every == 0:
            self._before = {name: _snapshot(m) for name, m in self.layers}

    def _post(self, optimizer, args, kwargs) -> None:
        if self._before is not None:
            self.steps.append((self._count, _compare(self.layers, self._before)))
            self._before = None
        self._count += 1

    def __enter__(self) -> RelativeUpdateLog:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self._handles = [register_optimizer_step_pre_hook(self._pre),
                         register_optimizer_step_post_hook(self._post)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
