"""``LowRankLinear``, the name of the fixed-rank low-rank layer before low-rank became a format:
kept for one release.

A low-rank layer ``y = x @ A @ B + b`` is the ``lowrank`` format
(:class:`comera.formats.lowrank.LowRank`): ``GatedLinear(in, out, format="lowrank",
ranks=r)``. Trained without the rank objective (lam 0, no late stage) its rank stays fixed, as
this layer's did; unlike it, the model's sizes and ``compression_ratio`` count it.
"""

from __future__ import annotations

import warnings

import torch

from comera.layers.linear import GatedLinear

__all__ = ["LowRankLinear"]


def LowRankLinear(in_features: int, out_features: int, rank: int, bias: bool = True,
                  dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> GatedLinear:
    """``GatedLinear(in_features, out_features, format="lowrank", ranks=rank)`` (deprecated:
    build that instead; the name goes in the next release)."""
    warnings.warn("LowRankLinear is GatedLinear(format='lowrank') at a fixed rank: build that "
                  "(train it without the rank objective to keep the rank); the name goes in "
                  "the next release.", DeprecationWarning, stacklevel=2)
    return GatedLinear(in_features, out_features, "lowrank", rank, bias=bias, dtype=dtype,
                       device=device)
