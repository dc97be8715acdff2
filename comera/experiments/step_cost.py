"""What one training step costs: its wall time and its peak memory, measured one way for all.

    cost = measure_step(model, optimizer, lambda: trainer.step(loss_fn(model, batch)), batch)
    print(cost.ms, cost.peak_bytes)

Peak memory is ``resident + peak extra``: ``resident`` is the bytes of the unique storages held
before the step with gradients set to None (parameters, buffers, the optimizer's state, the
inputs); ``peak extra`` is the most bytes allocated above that at any moment of one step
(forward, loss, backward with freshly allocated gradients, optimizer step). On the CPU it comes
from the torch profiler's allocation events; on CUDA from the allocator's peak statistic. The
step is measured after warm-up steps (which allocate the optimizer's state and build plans),
with tncomp's buffer pooling off, so every buffer is an allocation the count sees. Not counted:
the allocator's own overhead, Python objects, plan caches.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from comera.errors import ConfigError
from comera.numbers import is_int
from comera.ranks.size import gated_layers
from tncomp.extend import device_sync, time_calls

__all__ = ["StepCost", "measure_step", "peak_allocated_bytes", "probe_step", "resident_bytes",
           "storage_bytes", "tensors_in", "unpooled"]


@dataclass(frozen=True)
class StepCost:
    """Time and memory of one training step (see the module docstring)."""

    ms: float  # median wall time of the timed steps, in milliseconds
    step_ms: tuple[float, ...]  # every timed step
    resident_bytes: int  # held before a step: parameters, buffers, optimizer state, inputs
    peak_extra_bytes: int  # the most allocated above that during one step

    @property
    def peak_bytes(self) -> int:
        """The step's peak memory: resident plus the peak allocated during it."""
        return self.resident_bytes + self.peak_extra_bytes


def tensors_in(value: object, depth: int = 0) -> Iterator[Tensor]:
    """Every tensor inside optimizer state: dicts, sequences and plain objects (GaLore keeps
    its projection matrix on a projector object); modules and anything nested deeper than five
    levels are skipped."""
    if isinstance(value, Tensor):
        yield value
    elif depth > 4 or isinstance(value, str | bytes | nn.Module):
        return
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v, depth + 1)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from tensors_in(v, depth + 1)
    elif hasattr(value, "__dict__"):
        yield from tensors_in(vars(value), depth + 1)


def storage_bytes(tensors: Iterable[Tensor], seen: set | None = None) -> int:
    """Bytes of the storages behind ``tensors``, each counted once (also across calls that
    share ``seen``)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if storage.data_ptr() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def resident_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                   inputs: Iterable[Tensor] = ()) -> int:
    """Bytes of the unique storages held by ``model`` (parameters, buffers, gradients), the
    optimizer's state and ``inputs``; a storage shared by two of them counts once."""
    params = list(model.parameters())
    state = list(optimizer.state.values()) if optimizer is not None else []
    grads = (p.grad for p in params if p.grad is not None)
    return storage_bytes((*params, *model.buffers(), *grads, *tensors_in(state), *inputs))


def peak_allocated_bytes(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """The most bytes torch held allocated, above what was live before, during one ``fn()``
    on ``device`` (CPU: from the profiler's allocation events; CUDA: the allocator's peak)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    if device.type != "cpu":
        raise ConfigError(f"peak memory is measured on cpu or cuda, not {device.type!r}.")
    from torch.profiler import ProfilerActivity, profile

    with _quiet_kineto(), profile(activities=[ProfilerActivity.CPU],
                                  profile_memory=True) as prof:
        fn()
    # the raw allocation records (signed byte counts in time order): prof.events() attaches
    # allocations to ops and keeps only the frees at top level, so it cannot give a peak
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def _quiet_kineto() -> Iterator[None]:
    """The profiler's library (kineto) prints a start and a stop line to stderr per profile at
    its default log level; it reads ``KINETO_LOG_LEVEL`` when it first starts. Raised inside
    (a level the user set is kept), restored on exit."""
    if "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = "99"
    try:
        yield
    finally:
        os.environ.pop("KINETO_LOG_LEVEL", None)


@contextlib.contextmanager
def unpooled(model: nn.Module) -> Iterator[None]:
    """tncomp's buffer pools keep buffers between calls, where an allocation count cannot see
    them: pooling is off for ``model``'s gated layers inside, restored on exit."""
    saved = [(m, dict(m.compile_options)) for _, m in gated_layers(model)]
    for m, options in saved:
        m.compile_options = {**options, "pool_buffers": False}
    try:
        yield
    finally:
        for m, options in saved:
            m.compile_options = options


def measure_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[], object],
                 inputs: Iterable[Tensor] = (), steps: int = 2, warmup: int = 1,
                 device: torch.device | str = "cpu") -> StepCost:
    """Run ``warmup`` steps, then ``steps`` timed steps, then one step whose peak memory is
    measured (``warmup + steps + 1`` calls of ``step()``, which trains ``model`` with
    ``optimizer``). ``inputs``: the batch's tensors (counted as resident)."""
    for name, value, low in (("steps", steps, 1), ("warmup", warmup, 1)):
        if not is_int(value, low):
            raise ConfigError(f"{name}={value!r}; give an int >= {low} (warm-up allocates the "
                              "optimizer's state, which a measured step must not count).")
    device = torch.device(device)
    inputs = list(inputs)
    params = list(model.parameters())
    with unpooled(model):
        times = [t * 1e3 for t in time_calls({"step": step}, warmup, steps,
                                              device_sync(device))["step"]]
        for p in params:  # a step allocates its gradients afresh: they count in the peak
            p.grad = None
        resident = resident_bytes(model, optimizer, inputs)

        def measured() -> None:
            step()
            for p in params:  # freed inside the measured call, so nothing outlives it unseen
                p.grad = None

        extra = peak_allocated_bytes(measured, device)
    return StepCost(statistics.median(times), tuple(times), resident, extra)


def probe_step(model: nn.Module, loss: Callable[[nn.Module], Tensor], config: Any,
               tt: bool | None = None, inputs: Iterable[Tensor] = (),
               steps: int = 2) -> StepCost:
    """:func:`measure_step` of the training step a run of ``config`` (an
    :class:`~comera.experiments.engine.EngineConfig`) takes on ``model`` (CoMERA's, at its
    early-stage objective, unless ``config.format`` is ``"dense"``; ``tt``: the flag of before,
    deprecated, see :func:`~comera.experiments.task.run_format`), ``loss(model)`` giving the
    step's loss, at the learning rates
    of 0: the optimizer's state is allocated and every update computed, but ``model`` keeps the
    function it computes (CoMERA's bookkeeping may set pruned gate entries to exactly zero), so
    a trained model can be measured after its run."""
    from comera.experiments.checks import PRECISIONS
    from comera.experiments.optim_schedule import run_optimizer
    from comera.experiments.task import run_format
    from comera.formats.registry import DENSE
    from comera.training.trainers import CoMERATrainer, DenseTrainer

    format = run_format(config, tt, "probe_step(model, loss, replace(config, format={}), ...)")
    optimizer = run_optimizer(model, config if format == config.format
                              else replace(config, format=format))
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    trainer = (CoMERATrainer(model, optimizer, config.lam, config.regularizer,
                             config.max_grad_norm) if format != DENSE
               else DenseTrainer(model, optimizer, config.max_grad_norm))
    device = next(model.parameters()).device
    dtype = PRECISIONS[config.precision]

    def step() -> None:
        with (contextlib.nullcontext() if dtype is None
              else torch.autocast(device.type, dtype=dtype)):
            value = loss(model)
        trainer.step(value)

    return measure_step(model, optimizer, step, inputs, steps=steps, device=device)
