"""What autograd keeps for the backward, as the saved-tensor hooks see it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def saved_by_autograd(fn: Callable[..., Any], *args: Any) -> tuple[Any, int]:
    """``fn(*args)`` and the bytes of every tensor autograd packs for its backward meanwhile
    (each pack counted, as a memory budget sees it)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, total
