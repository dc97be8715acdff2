"""Calibration: each layer's input second moments, streamed over a model's forward passes.

``convert_(model, config, calibration=batches)`` runs the model (eval mode, no gradients) on each
batch with forward hooks on the modules it is about to convert, and accumulates per layer
``X^T X`` and the row count ``n`` in float64 (each batch's product in float32, or float64 for
float64 inputs), so a calibrated decomposition (:mod:`comera.formats.whitened`) minimises
the error of the layer's output on those inputs.
Memory is independent of the number of batches: ``in_features^2 * 8`` bytes per layer (a
768-wide layer: 4.5 MiB; 3072-wide: 72 MiB), plus one batch's activations.

A batch is whatever the model's forward takes: a tensor (``model(x)``), a mapping of keyword
arguments (``model(**batch)``, as HuggingFace models take a tokenizer's output) or a tuple or
list of positional arguments (``model(*batch)``); tensors inside are moved to the model's
device. An empty iterable, a batch the model rejects or inputs that are not finite raise
:class:`~comera.errors.ConfigError` before any layer is replaced, and the model's modes
(train / eval) are restored whatever happens.

Which input feeds which layer: a linear module's (``nn.Linear``, HuggingFace ``Conv1D``) first
argument; an ``nn.MultiheadAttention``'s ``query``, ``key`` and ``value`` for its split q, k and v
projections (all three, averaged, for the packed ``in_proj``). Its ``out_proj`` never runs as a
module (the attention reads its weight directly), so it has no statistics and is decomposed
plainly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from comera.errors import ConfigError
from comera.surgery.converters import IN_PARTS

log = logging.getLogger("comera.surgery.input_statistics")

__all__ = ["InputStats", "check_batches", "collect_input_stats", "gram_bytes"]


@dataclass(frozen=True)
class InputStats:
    """One layer's calibration inputs: ``gram = X^T X / rows`` (in x in, float64) and the
    number of input rows (tokens) seen."""

    gram: Tensor
    rows: int


class _Accumulator:
    """``X^T X`` and the row count of one layer, in float64, updated batch by batch."""

    def __init__(self, name: str):
        self.name = name
        self.sum: Tensor | None = None  # (in, in), made at the first input
        self.rows = 0

    def add(self, x: Any) -> None:
        width = None if self.sum is None else self.sum.shape[0]
        if not isinstance(x, Tensor) or x.dim() == 0 or width not in (None, x.shape[-1]):
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ConfigError(f"calibration: layer {self.name!r} received an input of shape "
                              f"{shape}; it takes (..., {width or 'features'}).")
        rows = x.detach().reshape(-1, x.shape[-1])  # (n, in)
        if rows.dtype != torch.float64:  # each batch's product in float32, the sum in float64
            rows = rows.to(torch.float32)
        if not bool(torch.isfinite(rows).all()):
            raise ConfigError(f"calibration: the inputs of layer {self.name!r} hold NaN or "
                              "infinite values; check the calibration batches (and the model's "
                              "earlier layers).")
        if self.sum is None:
            self.sum = rows.new_zeros(rows.shape[1], rows.shape[1], dtype=torch.float64)
        self.sum += (rows.T @ rows).to(torch.float64)
        self.rows += rows.shape[0]

    def stats(self) -> InputStats:
        return InputStats(self.sum / max(self.rows, 1), self.rows)


def gram_bytes(features: Iterable[int]) -> int:
    """Bytes the input statistics of layers of these input widths hold (float64 squares)."""
    return sum(8 * n * n for n in features)


def check_batches(batches: Any) -> Iterable:
    """``batches`` if it is an iterable of batches, else a :class:`ConfigError` saying how to
    pass one (a lone tensor or mapping would be iterated row by row or key by key)."""
    if isinstance(batches, Tensor):
        raise ConfigError(f"calibration is one tensor of shape {tuple(batches.shape)}; pass an "
                          "iterable of batches, e.g. calibration=[x] or x.split(32).")
    if isinstance(batches, Mapping | str | bytes):
        raise ConfigError(f"calibration is a {type(batches).__name__}; pass an iterable of "
                          "batches, e.g. calibration=[batch] for one batch of keyword "
                          "arguments, or a DataLoader.")
    if not isinstance(batches, Iterable):
        raise ConfigError(f"calibration={batches!r}; pass an iterable of batches (tensors, "
                          "dicts of keyword arguments or tuples of arguments), e.g. a list or "
                          "a DataLoader.")
    return batches


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, Mapping):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to(v, device) for v in value)
    return value


def _run(model: nn.Module, batch: Any, index: int) -> None:
    """One forward of ``model`` on ``batch``; whatever it raises becomes a ConfigError naming
    the batch (the hooks' own ConfigErrors pass through)."""
    try:
        if isinstance(batch, Tensor):
            model(batch)
        elif isinstance(batch, Mapping):
            model(**batch)
        elif isinstance(batch, list | tuple):
            model(*batch)
        else:
            raise ConfigError(f"calibration batch {index} is a {type(batch).__name__}; a batch "
                              "is a tensor, a dict of keyword arguments or a tuple of "
                              "positional arguments.")
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"calibration batch {index}: the model rejected it ({type(exc).__name__}"
                          f": {str(exc).splitlines()[0] if str(exc) else ''}); pass batches the "
                          "model's forward takes: a tensor (model(x)), a dict (model(**batch)) "
                          "or a tuple (model(*batch)).") from exc


def _attention_taps(name: str, packed: bool):
    """The hook of an nn.MultiheadAttention: its query / key / value into the q / k / v
    statistics (all three into ``in_proj`` when packed)."""
    parts = ("in_proj",) * 3 if packed else IN_PARTS
    names = [f"{name}.{p}" for p in parts]

    def tap(acc: dict[str, _Accumulator], args: tuple, kwargs: dict) -> None:
        values = [args[k] if len(args) > k else kwargs.get(key)
                  for k, key in enumerate(("query", "key", "value"))]
        for part, x in zip(names, values, strict=True):
            if part in acc:
                acc[part].add(x)
    return tap


def _linear_tap(name: str):
    def tap(acc: dict[str, _Accumulator], args: tuple, kwargs: dict) -> None:
        x = args[0] if args else next(iter(kwargs.values()), None)
        acc[name].add(x)
    return tap


def collect_input_stats(model: nn.Module, layers: Mapping[str, nn.Module], batches: Iterable,
                        packed_attention: bool = False,
                        progress: Callable[[int], None] | None = None
                        ) -> tuple[dict[str, InputStats], int]:
    """Per layer name, the :class:`InputStats` of its inputs over ``batches``, and the number
    of batches.

    ``layers``: the layer names to calibrate -> the module whose forward receives the input (a
    part of an ``nn.MultiheadAttention``, ``<name>.q_proj`` ..., maps to the attention module).
    ``progress``: called with the number of batches done after each one. Layers no batch
    reached are left out (they are decomposed plainly)."""
    batches = check_batches(batches)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    acc = {name: _Accumulator(name) for name in layers}
    taps: dict[nn.Module, Callable] = {}
    for name, module in layers.items():
        if isinstance(module, nn.MultiheadAttention):
            owner = name.rpartition(".")[0]
            taps.setdefault(module, _attention_taps(owner, packed_attention))
        else:
            taps[module] = _linear_tap(name)
    modes = {m: m.training for m in model.modules()}
    handles = [module.register_forward_pre_hook(
        lambda _m, args, kwargs, tap=tap: tap(acc, args, kwargs), with_kwargs=True)
        for module, tap in taps.items()]
    count = 0
    try:
        model.eval()
        with torch.no_grad():
            for count, batch in enumerate(batches, 1):
                _run(model, _to(batch, device), count - 1)
                if progress is not None:
                    progress(count)
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes.items():
            module.training = training
    if count == 0:
        raise ConfigError("calibration gave no batches (an empty iterable); pass at least one "
                          "batch of inputs, e.g. calibration=[x].")
    unseen = sorted(name for name, a in acc.items() if a.rows == 0)
    if unseen:
        log.warning("calibration: no input reached %s; decomposed without calibration",
                    ", ".join(unseen))
    log.info("calibration: %d batch(es), %s rows per layer, %.1f MiB of statistics", count,
             sorted({a.rows for a in acc.values()}),
             gram_bytes(a.sum.shape[0] for a in acc.values() if a.sum is not None) / 2**20)
    return {name: a.stats() for name, a in acc.items() if a.rows}, count
