"""Bit-identity of two models' parameters and buffers."""

from __future__ import annotations

import torch
from torch import nn


def assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    """``a`` and ``b`` hold the same state_dict names, in order, with equal values to the bit."""
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
