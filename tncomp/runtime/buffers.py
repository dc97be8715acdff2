"""A pool of reusable output buffers per plan step: a small caching allocator for the CPU.

On the CPU torch allocates large tensors with fresh pages each time, and the page faults cost
as much as the GEMM writing them (measured: a 4096x30 @ 30x3072 product took 40 ms into fresh
memory and 17 ms into a reused buffer). A pool hands a step a buffer whose storage nobody else
references any more (``use count == 1``: the pool's own reference), else a new one, keeping at
most ``limit`` of them. Outputs that leave the plan are returned as base tensors over the
pooled storage (not views), so autograd and in-place ops treat them like fresh tensors; their
storage returns to the pool only once every user reference is gone.
"""

from __future__ import annotations

import math

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

    __slots__ = ("_empty", "_storages", "device", "dtype", "limit", "nbytes", "shape", "strides")

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

    def take(self) -> torch.Tensor:
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
        self._storages.clear()


def alias(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A base (non-view) tensor of ``shape`` over the storage of contiguous ``tensor``."""
    out = torch.empty((0,), dtype=tensor.dtype, device=tensor.device)
    return out.set_(tensor.untyped_storage(), tensor.storage_offset(), shape,
                    contiguous_strides(shape))
