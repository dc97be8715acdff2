"""What every part of ``make gpu`` shares: the device's description, CUDA-event timing, peak
allocated memory, a time budget, and a writer that saves a part's results after every case (so
a part stopped at its budget still leaves what it measured).

A part runs as ``python -m benchmarks.gpu.<part> --out FILE.json --budget SECONDS``; ``--device
cpu --smoke`` runs the same code on the CPU at toy sizes (the CPU tests use it; its numbers are
not GPU results)."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.lib.measure import interleaved_times, spread

log = logging.getLogger("benchmarks.gpu")

NO_CUDA = "make gpu: no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine."


def device_info(device: str) -> dict[str, Any]:
    """The machine fingerprint (comera.experiments.results.machine) plus the CUDA runtime, the
    device's compute capability and memory."""
    from comera.experiments.results import machine

    info = machine(device)
    info["cuda"] = torch.version.cuda
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        info["capability"] = f"{props.major}.{props.minor}"
        info["device_memory_gib"] = round(props.total_memory / 2**30, 1)
    return info


@dataclass(frozen=True)
class Deadline:
    """A point in time (``time.monotonic()``) a part must finish by."""

    end: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, estimate_s: float) -> bool:
        """True when a case expected to take ``estimate_s`` seconds still fits."""
        return self.left() > estimate_s


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], device: str, repeats: int, warmup: int) -> list[float]:
    """Milliseconds of ``repeats`` calls of ``fn`` after ``warmup`` calls: CUDA events around
    each call on a GPU (device time, no host sync inside the timed region), the wall clock on
    the CPU (:func:`benchmarks.lib.measure.interleaved_times`, one function)."""
    times = interleaved_times({"fn": fn}, repeats, warmup, device=device)["fn"]
    return [t * 1e3 for t in times]


def allocated_bytes(device: str) -> int | None:
    """What the CUDA allocator holds for live tensors now (None on the CPU): taken at a case's
    start, it is what earlier cases left behind (a graph's private pool, a solver's cached
    workspace), which :func:`peak_bytes` leaves out of the case's own peak."""
    if not device.startswith("cuda"):
        return None
    _sync(device)
    return int(torch.cuda.memory_allocated())


def reserved_bytes(device: str, peak: bool = False) -> int | None:
    """What the CUDA allocator has reserved from the device (None on the CPU): now, after
    releasing its unused cache, or (``peak``) its most since the last reset. Unlike
    :func:`peak_bytes` it covers a CUDA graph's private pool, whose buffers a replay uses without
    allocating them: take it at a case's start and, with ``peak``, after :func:`peak_bytes`."""
    if not device.startswith("cuda"):
        return None
    _sync(device)
    if peak:
        return int(torch.cuda.max_memory_reserved())
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_reserved())


def peak_bytes(fn: Callable[[], object], device: str, since: int | None = 0) -> int | None:
    """``torch.cuda.max_memory_allocated`` during one call of ``fn`` (after the others warmed
    it), less ``since`` (:func:`allocated_bytes` at the case's start): everything the case
    allocated, the model, its optimizer state, the step's activations and any graph pool, and
    nothing an earlier case left. Under CUDA graphs it misses the pool's transient buffers (a
    replay allocates nothing): :func:`reserved_bytes` covers those. None on the CPU."""
    if not device.startswith("cuda"):
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats()
    fn()
    _sync(device)
    return int(torch.cuda.max_memory_allocated()) - (since or 0)


def summary(times: list[float]) -> dict[str, float]:
    """Median and range of a list of milliseconds (:func:`benchmarks.lib.measure.spread`)."""
    s = spread(times)
    return {"ms": s["median"], "ms_min": s["min"], "ms_max": s["max"], "repeats": s["repeats"]}


class PartWriter:
    """A part's JSON, rewritten atomically after every case, skip and error."""

    def __init__(self, path: str | Path, part: str, device: str, settings: dict[str, Any]):
        self.path = Path(path)
        self.payload: dict[str, Any] = {"part": part, "device": device_info(device),
                                        "settings": settings, "cases": [], "skipped": [],
                                        "errors": [], "complete": False}
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.payload, indent=2, default=str) + "\n")
        os.replace(tmp, self.path)

    def add(self, case: dict[str, Any]) -> None:
        self.payload["cases"].append(case)
        log.info("%s: %s", self.payload["part"], {k: v for k, v in case.items()
                                                  if k in ("case", "method", "ms")})
        self._write()

    def extend(self, name: str, key: str, values: dict[str, Any]) -> None:
        """Merge ``values`` into the dict ``key`` of the saved case ``name`` (a later pass adding
        a method to a case measured earlier)."""
        case = next(c for c in self.payload["cases"] if c["case"] == name)
        case.setdefault(key, {}).update(values)
        self._write()

    def skip(self, name: str, why: str) -> None:
        self.payload["skipped"].append({"case": name, "why": why})
        print(f"  skip {name}: {why}", flush=True)
        self._write()

    def error(self, name: str, exc: BaseException) -> None:
        self.payload["errors"].append({"case": name, "error": f"{type(exc).__name__}: {exc}",
                                       "where": traceback.format_exc(limit=4)[-1500:]})
        print(f"  error in {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        self._write()

    def note(self, key: str, value: Any) -> None:
        self.payload.setdefault("notes", {})[key] = value
        self._write()

    def done(self) -> None:
        self.payload["complete"] = True
        self._write()


def part_main(argv: list[str] | None, part: str,
              run: Callable[[PartWriter, Deadline, argparse.Namespace], None]) -> int:
    """Parse a part's command line, refuse a missing CUDA device (exit 2, nothing written), run
    the part under its budget and mark its results complete."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.gpu.{part}")
    p.add_argument("--out", required=True, help="the part's JSON file")
    p.add_argument("--budget", type=float, default=120.0, help="seconds for the whole part")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--smoke", action="store_true", help="toy sizes, one repeat (CPU tests)")
    p.add_argument("--repeats", type=int, default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    if args.budget <= 0:
        print(f"--budget {args.budget}: give the part's seconds (> 0).", file=sys.stderr)
        return 2
    deadline = Deadline.after(args.budget)
    logging.basicConfig(level=logging.WARNING)
    writer = PartWriter(args.out, part, args.device, {k: v for k, v in vars(args).items()
                                                      if k != "out"})
    run(writer, deadline, args)
    writer.done()
    return 0


def guarded(writer: PartWriter, deadline: Deadline, name: str, estimate_s: float,
            fn: Callable[[], dict[str, Any] | None]) -> None:
    """Run one case if the budget allows it; record its result, or its error, and go on (one
    failing case, an out-of-memory say, does not end the part)."""
    if not deadline.allows(estimate_s):
        writer.skip(name, f"time budget: {deadline.left():.0f} s left, the case needs "
                          f"~{estimate_s:.0f} s")
        return
    print(f"  {name} ({deadline.left():.0f} s left)", flush=True)
    try:
        result = fn()
    except Exception as exc:  # a case's failure is a result to report
        writer.error(name, exc)
        result = None
    finally:  # the case's model and optimizer are gone: give their memory back
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if result is not None:
        writer.add({"case": name, **result})
