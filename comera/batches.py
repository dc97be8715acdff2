"""Moving a batch to a device: one helper for every place that runs a model on user batches
(the engine's steps, calibration's forward passes, the summaries' step probes)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["to_device"]


def to_device(batch: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor inside it (in tuples, lists and mappings, at any depth) moved
    to ``device``; anything else is returned as it is. Containers keep their type (a mapping
    becomes a dict)."""
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(b, device, non_blocking) for b in batch)
    return batch
