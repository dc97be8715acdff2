"""Memory as the benchmarks count it, three ways, each saying what it sees; and the planning
memory mode of a model's TT layers (``--memory``).

- :func:`saved_bytes`: the bytes autograd saves for backward through ``save_for_backward`` and
  the built-in ops (``torch.autograd.graph.saved_tensors_hooks``), unique storages only. It does
  not see tensors a custom ``autograd.Function`` keeps on ``ctx`` by attribute (tncomp keeps its
  plan's intermediates that way), so compare layers with :func:`held_bytes` too.
- :func:`held_bytes`: the bytes allocated during a forward that are still live when it returns
  (everything kept for backward, by any route, plus the output), from the profiler's allocation
  events.
- :func:`peak_rss_delta`: the process's peak resident set during a call above its resident set
  before it (Linux: ``VmHWM`` after resetting it through ``/proc/self/clear_refs``). What a user
  sees, allocator caching and page reuse included: meaningful when the call allocates well
  beyond what the allocator already holds (tens of MiB and up), noise below that.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

import comera
from comera.errors import ConfigError

MEMORY_MODES = ("fast", "balanced", "min")  # tncomp's planning memory modes
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def saved_bytes(forward: Callable[[], Tensor]) -> dict[str, int]:
    """Run ``forward()`` once with saved-tensor hooks on: ``saved`` (bytes of the unique
    storages autograd saved) and ``output`` (the output's storage bytes); the output and the
    graph are freed on return."""
    storages: dict[tuple, int] = {}

    def pack(t: Tensor) -> Tensor:
        s = t.untyped_storage()
        storages[(t.device, s.data_ptr())] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forward()
    return {"saved": sum(storages.values()), "output": y.untyped_storage().nbytes()}


def held_bytes(forward: Callable[[], Tensor]) -> int:
    """Bytes allocated during one ``forward()`` and still live when it returns (its output
    included), measured from the profiler's allocation events after one warm call; the output
    and graph are freed on return."""
    from torch.profiler import ProfilerActivity, profile

    forward()  # warm: plans, pools and lazily built state are not counted
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = forward()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    del y
    return sum(e.nbytes() for e in events)


def rss_available() -> bool:
    """Whether this process can reset and read its peak resident set (Linux /proc)."""
    if not _STATUS.exists() or not _CLEAR_REFS.exists():
        return False
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def _status_kib(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def rss_bytes() -> int:
    """This process's resident set now (bytes)."""
    return _status_kib("VmRSS") * 1024


def reset_peak_rss() -> None:
    """Reset the peak resident set to the current one (Linux ``clear_refs`` 5)."""
    _CLEAR_REFS.write_text("5")


def peak_rss_bytes() -> int:
    """The process's peak resident set since start or the last :func:`reset_peak_rss`."""
    return _status_kib("VmHWM") * 1024


def peak_rss_delta(fn: Callable[[], object]) -> int | None:
    """Peak resident bytes during one ``fn()`` above the resident set just before it; None
    where the peak cannot be reset (not Linux)."""
    if not rss_available():
        return None
    reset_peak_rss()
    before = rss_bytes()
    fn()
    return max(0, peak_rss_bytes() - before)


def peak_rss_of(fn: Callable[[], object]) -> dict[str, int]:
    """Run ``fn()`` once (in a fresh process, after its imports): ``rss_before_bytes``, the
    resident set just before, ``peak_rss_bytes`` during, and ``peak_rss_delta_bytes``, their
    difference: what the call made the process hold at its worst, as the system sees it."""
    if not rss_available():
        raise ConfigError("peak RSS needs Linux /proc/self/clear_refs, which this system lacks.")
    gc.collect()
    before = rss_bytes()
    reset_peak_rss()
    fn()
    peak = peak_rss_bytes()
    return {"rss_before_bytes": before, "peak_rss_bytes": peak,
            "peak_rss_delta_bytes": peak - before}


def check_memory_mode(memory: str | None) -> None:
    """Refuse a planning memory mode this script does not know."""
    if memory is not None and memory not in MEMORY_MODES:
        raise ConfigError(f"memory={memory!r}; choose one of {', '.join(MEMORY_MODES)} (or "
                          "leave it out for tncomp's default).")


def set_memory_mode_(model: nn.Module, memory: str | None) -> None:
    """Plan every TT layer of ``model`` in the memory mode ``memory`` (None: leave them)."""
    if memory is None:
        return
    check_memory_mode(memory)
    for _, layer in comera.gated_layers(model):
        layer.memory = memory  # re-plans the layer
