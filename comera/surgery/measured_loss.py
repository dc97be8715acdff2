"""The model's loss on a list of batches: what ``floor="measured"`` compares.

``ConvertConfig(allocation="global", floor="measured")`` chooses between the global spend's
ranks and the uniform allocation's by the converted model's loss (as ASVD measures a layer's
sensitivity by the model's perplexity on calibration data, not by a truncation bound). The loss
of one batch is ``loss(output, batch)`` when the caller gives a loss function, else what the
model returned: a ``.loss`` attribute (HuggingFace models, given ``labels`` in the batch), a
``"loss"`` entry of a mapping, or the output itself when it is one number. The model's loss is
the mean over the batches (each batch counts once).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from comera.batches import to_device
from comera.errors import ConfigError
from comera.surgery.input_statistics import run_batch

__all__ = ["LossFn", "batch_loss", "model_loss"]

#: ``loss(output, batch) -> scalar tensor``: a batch's loss from the model's output
LossFn = Callable[[Any, Any], Tensor]


def batch_loss(output: Any, batch: Any, loss: LossFn | None = None, index: int = 0) -> float:
    """One batch's loss: ``loss(output, batch)``, else the output's own (see the module
    docstring), as a float; a :class:`ConfigError` when neither gives one number."""
    value = loss(output, batch) if loss is not None else _own_loss(output)
    if value is None:
        shape = (f"a tensor of shape {tuple(output.shape)}" if isinstance(output, Tensor)
                 else f"a {type(output).__name__}")
        raise ConfigError(f"floor='measured': measurement batch {index} gave {shape}, which "
                          "holds no loss (no .loss, no 'loss' key, not one number). Pass "
                          "loss=fn(output, batch) returning a scalar tensor, or batches the "
                          "model computes its loss on (a HuggingFace model: include labels).")
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ConfigError(f"floor='measured': the loss of measurement batch {index} has "
                              f"shape {tuple(value.shape)}; a loss is one number (reduce it, "
                              "e.g. with .mean()).")
        return float(value.detach().float())
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise ConfigError(f"floor='measured': the loss of measurement batch {index} is a "
                      f"{type(value).__name__}; a loss is a scalar tensor or a number.")


def _own_loss(output: Any) -> Any:
    found = getattr(output, "loss", None)
    if found is None and isinstance(output, Mapping):
        found = output.get("loss")
    if found is None and isinstance(output, Tensor) and output.numel() == 1:
        found = output
    return found


def model_loss(model: nn.Module, batches: Sequence, loss: LossFn | None = None) -> float:
    """The mean of :func:`batch_loss` over ``batches``, the model in eval mode without
    gradients (its modes restored after); infinite when a batch's loss is not finite."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    modes = {m: m.training for m in model.modules()}
    total = 0.0
    try:
        model.eval()
        with torch.no_grad():
            for index, batch in enumerate(batches):
                batch = to_device(batch, device)
                output = run_batch(model, batch, index, what="measurement batch")
                value = batch_loss(output, batch, loss, index)
                total += value if math.isfinite(value) else math.inf
    finally:
        for module, training in modes.items():
            module.training = training
    return total / len(batches)
