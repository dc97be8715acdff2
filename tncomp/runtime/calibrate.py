"""Measure a device's GEMM rate and memory bandwidth once, and keep them on disk.

The calibration of a device type is one JSON file in tncomp's cache directory. It is written
like a disk-cache entry: to a temp file of its own in the same directory, flushed to disk, then
renamed over the old file in one atomic step, so a reader (another process planning a network)
sees the old calibration, the new one or none, never half a file. A file that cannot be read or
holds something other than positive rates is logged and ignored (the defaults are used).
"""

from __future__ import annotations

import json
import logging
import math
import os  # noqa: F401  (tests/test_api.py patches tncomp.runtime.calibrate.os.replace)
import time
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path

import torch

from tncomp.compiler.cache import default_cache_dir
from tncomp.compiler.device_model import DeviceModel
from tncomp.errors import CacheError
from tncomp.files import atomic_write_bytes

log = logging.getLogger("tncomp.runtime.calibrate")

_RATES = ("gemm_flops_per_s", "bytes_per_s", "step_overhead_s")


def calibration_path(device: torch.device | str) -> Path:
    """Where the calibration of ``device``'s type is kept (one file per type: cpu, cuda, ...)."""
    return default_cache_dir() / f"calibration-{torch.device(device).type}.json"


def load_calibration(device: torch.device | str) -> DeviceModel | None:
    """The saved model of ``device``'s type, or None when absent, unreadable or malformed."""
    path = calibration_path(device)
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("tncomp: ignoring calibration %s (%s); using the default model", path, exc)
        return None
    names = {f.name for f in fields(DeviceModel)}
    ok = (isinstance(data, dict) and set(data) <= names and set(_RATES) <= set(data)
          and all(_positive(data[k]) for k in _RATES)
          and isinstance(data.get("source", ""), str))
    if not ok:
        log.warning("tncomp: ignoring calibration %s: it does not hold positive %s; using the "
                    "default model (run `tncomp calibrate` again)", path, ", ".join(_RATES))
        return None
    return DeviceModel(**data)


def save_calibration(model: DeviceModel, device: torch.device | str) -> Path:
    """Write ``model`` as the calibration of ``device``'s type, atomically; return the path.

    Raises :class:`CacheError` when the cache directory cannot be written.
    """
    path = calibration_path(device)
    data = json.dumps(asdict(model), indent=1).encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)  # temp file, fsync, rename, directory fsync
    except OSError as exc:
        raise CacheError(
            f"could not save the calibration to {str(path)!r} ({exc}); point TNCOMP_CACHE_DIR "
            "at a writable directory, or pass save=False."
        ) from None
    log.info("tncomp: saved calibration %s to %s", model.source, path)
    return path


def median_time(fn: Callable[[], object], repeats: int, sync: Callable[[], object]) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after two warm-up calls."""
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def calibrate(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              save: bool = True) -> DeviceModel:
    """Time a square GEMM, a large copy, and a tiny op; store and return the model."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n = 2048 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)  # (n, n)
    out = torch.empty_like(a)  # (n, n)
    gemm = 2 * n**3 / median_time(lambda: torch.mm(a, a, out=out), 5, sync)
    big = torch.empty(32 * 2**20 // 4, device=device, dtype=torch.float32).normal_()  # 32 MiB
    dst = torch.empty_like(big)
    bw = 2 * big.numel() * 4 / median_time(lambda: dst.copy_(big), 7, sync)
    tiny = torch.randn(4, 4, device=device, dtype=dtype)  # (4, 4)
    overhead = median_time(lambda: torch.mm(tiny, tiny), 50, sync)
    model = DeviceModel(gemm, bw, overhead, f"calibrated on {device.type} ({dtype})")
    if save:
        save_calibration(model, device)
    return model


def _positive(value: object) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)

