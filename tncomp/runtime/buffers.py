"""A pool of reusable output buffers per plan step: a small caching allocator for the CPU.

On the CPU torch allocates large tensors with fresh pages each time, and the page faults cost
as much as the GEMM writing them (docs/results.md, "Measured rules of the CPU executor"). A pool
hands a step a buffer whose storage nobody else references any more (``use count == 1``: the pool's
own reference), else a new one, keeping at most ``limit`` of them. Outputs that leave the plan are
returned as base tensors over the pooled storage (not views), so autograd and in-place ops treat
them like fresh tensors; their storage returns to the pool only once every user reference is gone.

Thread safety: one compiled network may be called from several threads at once. ``take()``
checks a storage is free and takes a reference to it under the pool's lock, so two threads
never receive the same buffer (without the lock, a thread switch between the check and the
take handed one storage to two calls, and one call's output turned into the other's). Releases
need no lock: they are reference-count drops. A lock measured as fast as per-thread pools and
keeps the pool bounded (``limit`` buffers in all, not per thread) and clearable from any thread.
"""

from __future__ import annotations

import math
import threading

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)

MIN_POOLED_BYTES = 1 << 18  # below this malloc reuses memory without page faults anyway
DEFAULT_LIMIT = 8


def pooling_available() -> bool:
    return _use_count is not None


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


class BufferPool:
    """Buffers of one shape, dtype and device; ``take()`` returns a free one as a tensor."""

    __slots__ = ("_empty", "_lock", "_storages", "device", "dtype", "limit", "nbytes", "shape",
                 "strides")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 limit: int = DEFAULT_LIMIT):
        self.shape = tuple(shape)
        self.strides = contiguous_strides(self.shape)
        self.dtype = dtype
        self.device = device
        self.limit = limit
        self.nbytes = math.prod(self.shape) * torch.empty((), dtype=dtype).element_size()
        self._storages: list = []
        self._empty = (0,)
        self._lock = threading.Lock()

    def take(self) -> torch.Tensor:
        """A buffer no one else references (a pooled one when free, else a new one)."""
        with self._lock:  # the use-count check and the new reference are one step
            for storage in self._storages:
                if _use_count(storage._cdata) == 1:
                    return self._tensor(storage)
            fresh = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            if len(self._storages) < self.limit:
                self._storages.append(fresh.untyped_storage())
            return fresh

    def _tensor(self, storage) -> torch.Tensor:
        out = torch.empty(self._empty, dtype=self.dtype, device=self.device)
        return out.set_(storage, 0, self.shape, self.strides)

    def __len__(self) -> int:
        return len(self._storages)

    def clear(self) -> None:
        with self._lock:
            self._storages.clear()


def alias(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A base (non-view) tensor of ``shape`` over the storage of contiguous ``tensor``."""
    out = torch.empty((0,), dtype=tensor.dtype, device=tensor.device)
    return out.set_(tensor.untyped_storage(), tensor.storage_offset(), shape,
                    contiguous_strides(shape))
