"""Bytes as torch.profiler's memory timeline records them (CPU tensors)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch


def profiled_peak(fn: Callable[[], Any]) -> int:
    """The peak of live CPU tensor bytes while ``fn`` runs, from torch.profiler's memory
    timeline (allocations and frees recorded with ``profile_memory=True``)."""
    np = pytest.importorskip("numpy")
    timeline = pytest.importorskip("torch.profiler._memory_profiler").MemoryProfileTimeline
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        fn()
    _times, sizes = timeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    return int(np.array(sizes).sum(axis=1).max())
