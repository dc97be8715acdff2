"""Shared timing and memory measurement for the benchmarks, and writing their results.

The one home of the benchmarks' timers: :func:`interleaved_times` (round-robin repeats after
warm-up, on the wall clock or CUDA events), :func:`spread` and :func:`ratio_spread` (medians
with quartiles and range), :func:`timed` (one call: a first call, a plan built). Memory:
resident bytes plus the profiled peak of one training step."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

import tncomp
from benchmarks.lib.cli import check_at_least_one
from comera.errors import ConfigError
from comera.experiments import step_cost
from comera.experiments.step_cost import storage_bytes, tensors_in, unpooled
from tncomp.runtime.device_timing import using_threads

RESULTS = Path(__file__).resolve().parent.parent / "results"


def smoke_device_model() -> tncomp.DeviceModel:
    """The default device model with a flat two-point GEMM-rate table: a smoke run measures
    nothing, but its square-rate and shape floors both take their code paths."""
    default = tncomp.DeviceModel()
    return dataclasses.replace(default, gemm_dims=(8, 4096),
                               gemm_rates=(default.gemm_flops_per_s,) * 8)


def square_rate_model(model: tncomp.DeviceModel) -> tncomp.DeviceModel:
    """``model`` without its GEMM-rate table: every GEMM at the square GEMM's rate (the
    planner's default, and the strict floor)."""
    return dataclasses.replace(model, gemm_dims=(), gemm_rates=())


class Timed(NamedTuple):
    """One measured call: what it returned, its wall-clock seconds and the process's CPU
    seconds over it."""

    value: Any
    seconds: float
    cpu_seconds: float


def timed(fn: Callable[[], object]) -> Timed:
    """Call ``fn`` once and time it (a first call, a plan built: what happens once)."""
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn()
    return Timed(value, time.perf_counter() - wall, time.process_time() - cpu)


def _is_cuda(device: str | torch.device | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def thread_clock() -> float:
    """The calling thread's CPU time, in seconds: on a machine shared with other jobs, the time
    a step spends descheduled is left out (memory-bandwidth contention is not)."""
    return time.thread_time()


def time_call(fn: Callable[[], object], *, inner: int = 1,
              device: str | torch.device | None = None) -> float:
    """Seconds per call of ``inner`` calls of ``fn`` in a row: the wall clock, or on a CUDA
    ``device`` CUDA events around the calls (device time; the queue drained first, no host
    synchronization inside the timed region)."""
    if _is_cuda(device):
        torch.cuda.synchronize(device)
        start, stop = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3 / inner
    start_s = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start_s) / inner


def interleaved_times(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 3, *,
                      inner: int = 1,
                      device: str | torch.device | None = None) -> dict[str, list[float]]:
    """Seconds per call of each function in each of ``repeats`` rounds, timed round-robin
    (round k times every function once, in order: ``inner`` calls in a row, averaged;
    :func:`time_call`) after ``warmup`` untimed calls each, so drift hits all alike. The one
    timing loop of the benchmarks: a single function is timed as a dict of one."""
    for name, value in (("repeats", repeats), ("inner", inner)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r}; time each function at least once.")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ConfigError(f"warmup={warmup!r}; give a count of untimed calls, 0 or more.")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(time_call(fn, inner=inner, device=device))
    return times


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int,
                        warmup: int = 3) -> dict[str, float]:
    """Median seconds per call of each function (:func:`interleaved_times`)."""
    return {name: statistics.median(ts)
            for name, ts in interleaved_times(fns, repeats, warmup).items()}


def spread(times: list[float]) -> dict[str, float | int]:
    """The median of repeated times, with their quartiles and range: what a timing reports."""
    if not times:
        raise ConfigError("spread of no times; time at least once.")
    ordered = sorted(times)
    q1, _, q3 = (statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1
                 else (ordered[0],) * 3)
    return {"median": statistics.median(ordered), "q1": q1, "q3": q3, "min": ordered[0],
            "max": ordered[-1], "repeats": len(ordered)}


def ratio_spread(num: list[float], den: list[float]) -> dict[str, float | int]:
    """How much a time ratio ``num / den`` moves over interleaved repeats: the ratio of the
    medians, and the quartiles and range of the per-round ratios ``num[k] / den[k]`` (round k
    timed both within moments of each other)."""
    if len(num) != len(den) or not num:
        raise ConfigError(f"ratio_spread needs two equal, non-empty lists of times; got "
                          f"{len(num)} and {len(den)}.")
    rounds = spread([ratio(a, b) for a, b in zip(num, den, strict=True)])
    return {"ratio": ratio(statistics.median(num), statistics.median(den)),
            **{k: rounds[k] for k in ("q1", "q3", "min", "max", "repeats")}}


def spread_text(spread: dict) -> str:
    """``1.12x (IQR 1.05-1.20, range 0.99-1.31 over 25)``: a ratio with its spread."""
    return (f"{spread['ratio']:.2f}x (IQR {spread['q1']:.2f}-{spread['q3']:.2f}, range "
            f"{spread['min']:.2f}-{spread['max']:.2f} over {spread['repeats']})")


def peak_allocated_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes torch allocated during one call above what was live before it, after one
    warm-up call (steady-state allocations only): :func:`comera.experiments.step_cost.
    peak_allocated_bytes`, the one home of the measurement."""
    fn()
    return step_cost.peak_allocated_bytes(fn)


def resident_bytes(model: nn.Module, optimizer: torch.optim.Optimizer,
                   inputs: Iterable[Tensor] = ()) -> dict[str, int]:
    """Bytes of the unique storages held by the model (parameters, buffers, gradients), the
    optimizer state and ``inputs``, plus their ``total``; a storage shared by two groups counts
    in the first."""
    seen: set = set()
    total = lambda tensors: storage_bytes(tensors, seen)  # noqa: E731
    params = list(model.parameters())
    out = {
        "params": total(params),
        "buffers": total(model.buffers()),
        "grads": total(p.grad for p in params if p.grad is not None),
        "optimizer_state": total(tensors_in(list(optimizer.state.values()))),
        "inputs": total(inputs),
    }
    out["total"] = sum(out.values())
    return out


def measure_step_memory(model: nn.Module, optimizer: torch.optim.Optimizer,
                        step: Callable[[], object], inputs: Iterable[Tensor] = ()) -> dict:
    """Peak memory of one whole training step ``step()`` of ``model``; runs two steps.

    Returns ``resident_bytes`` (held before the step, gradients set to None, ``inputs``
    included), ``peak_extra_bytes`` (the profiled peak allocated above that during one step,
    tncomp pooling off), ``grads_bytes`` (the gradients at the end of the step, part of the
    peak), ``activations_and_temporaries_bytes`` (peak minus gradients) and
    ``peak_total_bytes`` (resident total plus the peak).
    """
    record: dict[str, int] = {}
    params = list(model.parameters())

    def clear_grads() -> None:
        for p in params:
            p.grad = None

    def profiled_step() -> None:
        step()
        record["grads"] = resident_bytes(model, optimizer)["grads"]
        clear_grads()  # freed inside the profiled call, so nothing outlives it unseen

    clear_grads()
    with unpooled(model):
        extra = peak_allocated_bytes(profiled_step)
    resident = resident_bytes(model, optimizer, inputs)
    return {"resident_bytes": resident, "peak_extra_bytes": extra,
            "grads_bytes": record["grads"],
            "activations_and_temporaries_bytes": extra - record["grads"],
            "peak_total_bytes": resident["total"] + extra}


def num_threads(n: int) -> contextlib.AbstractContextManager[None]:
    """Run the body with ``torch.set_num_threads(n)``, restoring the previous count on exit
    (:func:`tncomp.runtime.device_timing.using_threads`: a count from 1 to the usable CPUs)."""
    return using_threads(n)


def start_run(parser: argparse.ArgumentParser, threads: int | None) -> None:
    """What a model benchmark does before it measures: timestamped logging, and ``--threads``
    (checked: at least 1) handed to torch."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    check_at_least_one(parser, argparse.Namespace(threads=threads), "threads")
    if threads is not None:
        torch.set_num_threads(threads)


def ratio(num: float, den: float) -> float:
    """``num / den``, or infinity when ``den`` is not positive (a ratio against nothing)."""
    return num / den if den > 0 else math.inf


def write_results(name: str, payload: dict, markdown: str) -> tuple[Path, Path]:
    """``payload`` as JSON and ``markdown`` under benchmarks/results/ as ``name``.{json,md}."""
    return write_results_to(str(RESULTS / name), payload, markdown)


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results_to(out: str, payload: dict, markdown: str) -> tuple[Path, Path]:
    """A bare name goes to benchmarks/results/; a path (with or without ``.json``) is written
    in the same format next to where it points."""
    base = RESULTS / out if "/" not in out and not out.endswith(".json") else Path(out)
    base = base.with_suffix("") if base.suffix == ".json" else base
    base.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = base.with_name(base.name + ".json"), base.with_name(base.name + ".md")
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    md_path.write_text(markdown + "\n")
    return json_path, md_path


def publish(out: str, payload: dict, markdown: str) -> int:
    """Every benchmark's ending: write the results (:func:`write_results_to`), print the table
    and where it went. Returns the exit status, 0."""
    json_path, md_path = write_results_to(out, payload, markdown)
    print(markdown)
    print(f"wrote {json_path} and {md_path}")
    return 0


def run_fresh(module: str, args: list[str]) -> dict:
    """Run ``python -m module *args`` in a fresh interpreter from the repository root (nothing
    imported, planned or allocated before) and return the JSON object on its last stdout line."""
    root = RESULTS.parent.parent
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=root, env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"python -m {module} {' '.join(args)} failed:\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
