"""Measure a device's GEMM rate and memory bandwidth once, and keep them on disk.

The calibration of a device type is one JSON file in tncomp's cache directory. It is written
like a disk-cache entry: to a temp file of its own in the same directory, flushed to disk, then
renamed over the old file in one atomic step, so a reader (another process planning a network)
sees the old calibration, the new one or none, never half a file. A file that cannot be read or
holds something other than positive rates is logged and ignored (the defaults are used).

Besides a square GEMM, a copy and a tiny op, :func:`calibrate` times GEMMs on a small grid of
thin and square shapes (:data:`GEMM_GRID`) so the model knows what a thin GEMM really runs at
(:meth:`~tncomp.compiler.device_model.DeviceModel.gemm_rate`). Rates are measured at the
current ``torch.get_num_threads()``.
"""

from __future__ import annotations

import json
import logging
import math
import os  # (tests/test_api.py also patches tncomp.runtime.device_timing.os.replace)
import time
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path

import torch

from tncomp.compiler.cache import default_cache_dir, make_private_dir, read_bounded
from tncomp.compiler.device_model import DeviceModel
from tncomp.errors import CacheError
from tncomp.files import atomic_write_bytes

log = logging.getLogger("tncomp.runtime.device_timing")

_RATES = ("gemm_flops_per_s", "bytes_per_s", "step_overhead_s")
_TABLE = ("gemm_dims", "gemm_rates")
_SLOWDOWNS = ("transpose_slowdown", "gather_slowdown")
GEMM_GRID = (8, 32, 128, 512, 4096)  # m, n and k of the measured GEMMs: thin (TT ranks) to wide
GEMM_GRID_CUDA = (8, 32, 128, 512, 4096, 16384)
MAX_GRID_FLOPS = 2 * 512 * 512 * 4096  # larger grid points run at the square GEMM's rate


def device_memory(device: torch.device | str) -> int | None:
    """Bytes of memory ``device`` has (the machine's for the CPU), or None when unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cpu":
        try:
            return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (AttributeError, OSError, ValueError):  # not a POSIX system
            return None
    return None


def calibration_path(device: torch.device | str) -> Path:
    """Where the calibration of ``device``'s type is kept (one file per type: cpu, cuda, ...)."""
    return default_cache_dir() / f"calibration-{torch.device(device).type}.json"


def load_calibration(device: torch.device | str) -> DeviceModel | None:
    """The saved model of ``device``'s type, or None when absent, unreadable or malformed."""
    path = calibration_path(device)
    try:
        data = json.loads(read_bounded(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, CacheError) as exc:
        log.warning("tncomp: ignoring calibration %s (%s); using the default model", path, exc)
        return None
    names = {f.name for f in fields(DeviceModel)}
    ok = (isinstance(data, dict) and set(data) <= names and set(_RATES) <= set(data)
          and all(_positive(data[k]) for k in _RATES)
          and isinstance(data.get("source", ""), str))
    ok = ok and all(_positive(data[k]) for k in _SLOWDOWNS if k in data)
    if ok and any(k in data for k in _TABLE):
        ok = (all(isinstance(data.get(k), list) for k in _TABLE)
              and all(isinstance(v, int) and _positive(v) for v in data["gemm_dims"])
              and all(_positive(v) for v in data["gemm_rates"]))
        if ok:
            data = {**data, **{k: tuple(data[k]) for k in _TABLE}}
    try:
        model = DeviceModel(**data) if ok else None
    except ValueError:  # a table of the wrong length, or sizes out of order
        model = None
    if model is None:
        log.warning("tncomp: ignoring calibration %s: it does not hold positive %s; using the "
                    "default model (run `tncomp calibrate` again)", path, ", ".join(_RATES))
        return None
    return model


def save_calibration(model: DeviceModel, device: torch.device | str) -> Path:
    """Write ``model`` as the calibration of ``device``'s type, atomically; return the path.

    Raises :class:`CacheError` when the cache directory cannot be written.
    """
    path = calibration_path(device)
    fields_ = asdict(model)
    if not model.gemm_dims:  # no table: the file of a model without one
        for k in _TABLE:
            del fields_[k]
    data = json.dumps(fields_, indent=1).encode()
    try:
        make_private_dir(path.parent)
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


def best_time(fn: Callable[[], object], repeats: int, sync: Callable[[], object]) -> float:
    """Least seconds of ``fn`` over ``repeats`` calls after one warm-up call: on a shared
    machine the least time is the reproducible one (others' load only adds)."""
    fn()
    sync()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def gemm_table(device: torch.device, dtype: torch.dtype, sync: Callable[[], object],
               peak: float, overhead: float, grid: tuple[int, ...] = GEMM_GRID,
               max_flops: float = MAX_GRID_FLOPS, repeats: int = 3) -> tuple[float, ...]:
    """FLOP/s of ``(m x k) @ (k x n)`` for every ``m, n, k`` in ``grid`` (m-major), the
    :class:`DeviceModel` table (least of ``repeats`` times). The per-call overhead is taken off
    each time (the model adds it once per step); points above ``max_flops`` are given the
    square GEMM's rate ``peak``."""
    rates = []
    for m in grid:
        for n in grid:
            for k in grid:
                flops = 2 * m * n * k
                if flops > max_flops:
                    rates.append(peak)
                    continue
                a = torch.randn(m, k, device=device, dtype=dtype)  # (m, k)
                b = torch.randn(k, n, device=device, dtype=dtype)  # (k, n)
                out = torch.empty(m, n, device=device, dtype=dtype)  # (m, n)
                t = best_time(lambda a=a, b=b, out=out: torch.mm(a, b, out=out), repeats, sync)
                rates.append(flops / max(t - overhead, 0.25 * t))
    return tuple(rates)


def calibrate(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              save: bool = True, shapes: bool = False) -> DeviceModel:
    """Time a square GEMM, a large copy, a 2-D transpose and a gather of the same bytes (their
    slowdowns against the copy), a tiny op and (``shapes``) the GEMM grid of
    :func:`gemm_table`; store and return the model.

    ``shapes`` is off by default: the table predicts a plan's time better (768x3072 TT layer,
    B=4096, 1 thread: 76 ms modelled with it, 55 ms without, 89 ms measured), but a
    5-point grid misjudges thin GEMMs with large outputs, and planning with it picked a slower
    tree there (its heavy GEMMs measured 172 ms against 152 ms for the flat model's tree, on a
    loaded 2-core machine). ``compile(..., autotune=True)`` measures instead of modelling."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n = 2048 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)  # (n, n)
    out = torch.empty_like(a)  # (n, n)
    gemm = 2 * n**3 / median_time(lambda: torch.mm(a, a, out=out), 5, sync)
    big = torch.empty(32 * 2**20 // 4, device=device, dtype=torch.float32).normal_()  # 32 MiB
    dst = torch.empty_like(big)
    bw = 2 * big.numel() * 4 / median_time(lambda: dst.copy_(big), 7, sync)
    copy_s = 2 * big.numel() * 4 / bw
    matrix = big.view(2048, -1)  # (2048, 4096): a blocked 2-D transpose
    transposed = torch.empty(matrix.t().shape, device=device)  # contiguous (empty_like is not)
    transpose = median_time(lambda: transposed.copy_(matrix.t()), 5, sync) / copy_s
    cube = big.view(8, 32, -1)  # (8, 32, 32768): runs of one element read far apart
    gathered = torch.empty(cube.permute(2, 1, 0).shape, device=device)
    gather = median_time(lambda: gathered.copy_(cube.permute(2, 1, 0)), 3, sync) / copy_s
    tiny = torch.randn(4, 4, device=device, dtype=dtype)  # (4, 4)
    overhead = median_time(lambda: torch.mm(tiny, tiny), 50, sync)
    dims: tuple[int, ...] = ()
    rates: tuple[float, ...] = ()
    if shapes:
        dims = GEMM_GRID if device.type == "cpu" else GEMM_GRID_CUDA
        rates = gemm_table(device, dtype, sync, gemm, overhead, dims,
                           MAX_GRID_FLOPS if device.type == "cpu" else 64 * MAX_GRID_FLOPS)
    model = DeviceModel(gemm, bw, overhead, f"calibrated on {device.type} ({dtype}, "
                        f"{torch.get_num_threads()} threads)", dims, rates,
                        max(transpose, 1.0), max(gather, 1.0))
    if save:
        save_calibration(model, device)
    return model


def _positive(value: object) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)

