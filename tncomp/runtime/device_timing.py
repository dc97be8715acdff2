"""Measure a device's GEMM rate and memory bandwidth once, and keep them on disk.

The calibration of a device type is one JSON file in tncomp's cache directory. It is written
like a disk-cache entry: to a temp file of its own in the same directory, flushed to disk, then
renamed over the old file in one atomic step, so a reader (another process planning a network)
sees the old calibration, the new one or none, never half a file. A file that cannot be read,
is not plain JSON data (:func:`~tncomp.compiler.cache.read_json`: huge ints, NaN, deep
nesting) or holds anything but finite positive rates (or a GEMM table with implausible rates) is
logged and ignored: the defaults are used. ``tncomp cache clear`` removes the files
(:func:`remove_calibrations`).

Besides a square GEMM, a copy and a tiny op, :func:`calibrate` times GEMMs on a small grid of
thin and square shapes (:data:`GEMM_GRID`) so the model knows what a thin GEMM really runs at
(:meth:`~tncomp.compiler.device_model.DeviceModel.gemm_rate`). Rates are measured at
``threads`` (default: the current ``torch.get_num_threads()``). Measurements taken while other
work holds the cores are refused, not saved: the square GEMM is timed again at the end and must
agree with the first time within :data:`SQUARE_SPREAD`, and a grid point far slower than the
square rate predicts (:meth:`~tncomp.compiler.device_model.DeviceModel.implausible_rates`) is
timed again up to :data:`RETRIES` times before the calibration is refused
(:class:`~tncomp.errors.CalibrationError`).

It is also the library's one timer: :func:`time_calls` (functions, warm-up, repeats, the
device's sync in; seconds per call out), which every timing of tncomp and comera reduces.
"""

from __future__ import annotations

import json
import logging
import math
import os  # (tests/test_api.py also patches tncomp.runtime.device_timing.os.replace)
import re
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import TypeVar

import torch

from tncomp.compiler.cache import default_cache_dir, make_private_dir, read_json
from tncomp.compiler.device_model import DeviceModel
from tncomp.errors import CacheError, CalibrationError, OptionError
from tncomp.files import TEMP_SUFFIX, atomic_write_bytes

__all__ = ["GEMM_GRID", "GEMM_GRID_CUDA", "MAX_GRID_FLOPS", "RETRIES", "SQUARE_N",
           "SQUARE_N_CUDA", "SQUARE_SPREAD", "best_time", "calibrate", "calibration_files",
           "calibration_path", "check_calibration", "check_threads", "device_memory",
           "device_sync", "gemm_rate_of", "gemm_table", "load_calibration", "median_time",
           "no_sync", "remove_calibrations", "save_calibration", "time_calls", "upper_median",
           "usable_cpus", "using_threads"]

log = logging.getLogger("tncomp.runtime.device_timing")

_RATES = ("gemm_flops_per_s", "bytes_per_s", "step_overhead_s")
_TABLE = ("gemm_dims", "gemm_rates")
_SLOWDOWNS = ("transpose_slowdown", "gather_slowdown")
_CALIBRATION_NAME = re.compile(  # calibration-<type>.json, and its writers' temp files
    r"^(calibration-[a-z0-9_]+\.json|\.calibration-[a-z0-9_]+\.json\.[0-9]+-[0-9a-f]+"
    + re.escape(TEMP_SUFFIX) + ")$")
GEMM_GRID = (8, 32, 128, 512, 4096)  # m, n and k of the measured GEMMs: thin (TT ranks) to wide
GEMM_GRID_CUDA = (8, 32, 128, 512, 4096, 16384)
MAX_GRID_FLOPS = 2 * 512 * 512 * 4096  # larger grid points run at the square GEMM's rate
MAX_GRID_DIM = 2**31  # a grid size beyond this is no GEMM a device runs
SQUARE_SPREAD = 2.0  # the square GEMM timed at the start and at the end agree within this factor
SQUARE_N, SQUARE_N_CUDA = 2048, 8192  # the square GEMM's size, the rate of large GEMMs
RETRIES = 2  # times an implausible grid point is timed again before the calibration is refused


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
    """The saved model of ``device``'s type, or None when absent, unreadable or malformed
    (logged: the defaults are used)."""
    path = calibration_path(device)
    try:
        data = read_json(path)
    except FileNotFoundError:
        return None
    except (OSError, CacheError) as exc:
        log.warning("tncomp: ignoring calibration (%s); using the default model (`tncomp cache "
                    "clear` removes the file)", str(exc).rstrip("."))
        return None
    model = _model_of(data)
    if model is None:
        log.warning("tncomp: ignoring calibration %s: it does not hold a device model (finite "
                    "positive %s, and only the model's fields, each of its type); using the "
                    "default model (run `tncomp calibrate` again)", path, ", ".join(_RATES))
        return None
    bad = model.implausible_rates()
    if bad:
        log.warning("tncomp: ignoring calibration %s: %d of its GEMM rates are implausible "
                    "(worst: %s); using the default model (run `tncomp calibrate --shapes` "
                    "again on an idle machine, or with --threads 1)", path, len(bad), bad[0])
        return None
    return model


def _model_of(data: object) -> DeviceModel | None:
    """The :class:`DeviceModel` a calibration file's JSON describes, or None unless it holds
    exactly the model's fields, each of its type: finite positive rates, a table of positive
    sizes and rates."""
    names = {f.name for f in fields(DeviceModel)}
    if not (isinstance(data, dict) and set(data) <= names and set(_RATES) <= set(data)
            and isinstance(data.get("source", ""), str)
            and all(_positive(data[k]) for k in (*_RATES, *_SLOWDOWNS) if k in data)):
        return None
    if any(k in data for k in _TABLE):
        dims, rates = data.get("gemm_dims"), data.get("gemm_rates")
        if not (isinstance(dims, list) and isinstance(rates, list)
                and all(isinstance(v, int) and _positive(v) and v <= MAX_GRID_DIM for v in dims)
                and all(_positive(v) for v in rates)):
            return None
        data = {**data, "gemm_dims": tuple(dims), "gemm_rates": tuple(float(v) for v in rates)}
    try:
        return DeviceModel(**data)
    except ValueError:  # a table of the wrong length, or sizes out of order
        return None


def calibration_files(directory: Path | str | None = None) -> list[Path]:
    """The calibration files in ``directory`` (default: tncomp's cache directory), and the temp
    files of calibrations being written or killed mid-write."""
    directory = Path(directory) if directory is not None else default_cache_dir()
    try:
        names = os.listdir(directory)
    except OSError:  # absent, or not a directory
        return []
    return sorted(directory / n for n in names if _CALIBRATION_NAME.match(n))


def remove_calibrations(directory: Path | str | None = None) -> list[Path]:
    """Remove every calibration file (of every device type) from ``directory`` (default:
    tncomp's cache directory), without reading them; return those removed. ``compile`` then
    plans with the default models until ``tncomp calibrate`` runs again."""
    removed = []
    for path in calibration_files(directory):
        try:
            path.unlink()  # a link is removed, not followed
            removed.append(path)
        except FileNotFoundError:  # removed meanwhile
            continue
        except OSError as exc:  # a directory planted at the name, say
            log.warning("tncomp: could not remove %s (%s)", path, exc)
    return removed


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


def no_sync() -> None:
    """Wait for nothing: a CPU call has finished when it returns."""


def device_sync(device: torch.device | str) -> Callable[[], None]:
    """What waits for ``device``'s queued work before a clock is read: CUDA's
    ``synchronize`` on a CUDA device, :func:`no_sync` elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return no_sync


K = TypeVar("K", bound=Hashable)


def time_calls(fns: Mapping[K, Callable[[], object]], warmup: int, repeats: int,
               sync: Callable[[], object] = no_sync,
               before: Callable[[K], object] | None = None) -> dict[K, list[float]]:
    """Seconds of each call of every function of ``fns``: ``warmup`` untimed calls of each,
    then ``repeats`` rounds, round k timing every function once in order (interleaved, so
    drift hits all alike). ``sync`` waits for the device (:func:`device_sync`): before each
    clock read, so a time holds the call's queued work and nothing before it. ``before(key)``
    runs untimed before every call of ``fns[key]`` (e.g. setting a thread count).

    The library's one timing loop: :func:`median_time`, :func:`best_time`, autotune's
    orientations, ``comera``'s thread choice and step cost reduce what it returns (the
    benchmarks keep theirs in ``benchmarks/lib/measure.py``)."""
    for name, value, low in (("warmup", warmup, 0), ("repeats", repeats, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise OptionError(f"{name}={value!r}; give a whole number of calls >= {low}.")
    for key, fn in fns.items():
        for _ in range(warmup):
            if before is not None:
                before(key)
            fn()
    times: dict[K, list[float]] = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            if before is not None:
                before(key)
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[key].append(time.perf_counter() - start)
    return times


def upper_median(times: Sequence[float]) -> float:
    """The middle of ``times`` sorted (of an even count, the upper of the two middle ones)."""
    return sorted(times)[len(times) // 2]


def median_time(fn: Callable[[], object], repeats: int, sync: Callable[[], object]) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after two warm-up calls
    (:func:`time_calls`, :func:`upper_median`)."""
    return upper_median(time_calls({"fn": fn}, 2, repeats, sync)["fn"])


def best_time(fn: Callable[[], object], repeats: int, sync: Callable[[], object]) -> float:
    """Least seconds of ``fn`` over ``repeats`` calls after one warm-up call
    (:func:`time_calls`): on a shared machine the least time is the reproducible one (others'
    load only adds)."""
    return min(time_calls({"fn": fn}, 1, repeats, sync)["fn"])


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
                if 2 * m * n * k > max_flops:
                    rates.append(peak)
                else:
                    rates.append(gemm_rate_of(m, n, k, device, dtype, sync, overhead, repeats))
    return tuple(rates)


def gemm_rate_of(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype,
                 sync: Callable[[], object], overhead: float, repeats: int = 3) -> float:
    """FLOP/s of one ``(m x k) @ (k x n)`` GEMM (least of ``repeats`` times, the per-call
    ``overhead`` taken off)."""
    a = torch.randn(m, k, device=device, dtype=dtype)  # (m, k)
    b = torch.randn(k, n, device=device, dtype=dtype)  # (k, n)
    out = torch.empty(m, n, device=device, dtype=dtype)  # (m, n)
    t = best_time(lambda: torch.mm(a, b, out=out), repeats, sync)
    return 2 * m * n * k / max(t - overhead, 0.25 * t)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the system says, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_threads(threads: object, where: str = "threads") -> int:
    """``threads`` if it is a thread count this process can use (an int from 1 to
    :func:`usable_cpus`), else an :class:`OptionError` naming ``where`` and the range: more
    threads than CPUs only measures threads waiting for each other."""
    cpus = usable_cpus()
    if isinstance(threads, int) and not isinstance(threads, bool) and 1 <= threads <= cpus:
        return threads
    raise OptionError(f"{where}={threads!r}; give a number of threads from 1 to {cpus} (the "
                      "CPUs this process may use), e.g. 1 on a machine others share.")


@contextmanager
def using_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(threads)`` (checked by
    :func:`check_threads`), restoring the count after; None leaves it as it is. The count is
    process-wide: other threads' torch work runs at it meanwhile."""
    if threads is None:
        yield
        return
    threads = check_threads(threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def calibrate(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              save: bool = True, shapes: bool = False, threads: int | None = None,
              ) -> DeviceModel:
    """Time a square GEMM, a large copy, a 2-D transpose and a gather of the same bytes (their
    slowdowns against the copy), a tiny op and (``shapes``) the GEMM grid of
    :func:`gemm_table`, at ``threads`` threads (default: the current count); check that the
    measurements are plausible; store and return the model.

    A :class:`~tncomp.errors.CalibrationError` (nothing saved) when the square GEMM's rate at
    the end differs from the one at the start by more than :data:`SQUARE_SPREAD` times, or a
    grid point is still implausible (:meth:`DeviceModel.implausible_rates`) after
    :data:`RETRIES` more timings: the machine was busy.

    ``shapes`` is off by default: the table predicts a plan's time better, but a 5-point grid
    misjudges thin GEMMs with large outputs, and planning with it has picked slower trees
    (measurements in docs/results.md). ``compile(..., autotune=True)`` measures instead of
    modelling."""
    device = torch.device(device)
    if threads is not None:
        threads = check_threads(threads)
    with using_threads(threads):
        model = _measured(device, dtype, shapes)
    if save:
        save_calibration(model, device)
    return model


def _measured(device: torch.device, dtype: torch.dtype, shapes: bool) -> DeviceModel:
    """The model :func:`calibrate` measures, refused when implausible."""
    sync = device_sync(device)
    n = SQUARE_N if device.type == "cpu" else SQUARE_N_CUDA
    a = torch.randn(n, n, device=device, dtype=dtype)  # (n, n)
    out = torch.empty_like(a)  # (n, n)

    def square() -> float:
        return 2 * n**3 / median_time(lambda: torch.mm(a, a, out=out), 5, sync)

    gemm = square()
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
    threads = torch.get_num_threads()
    model = DeviceModel(gemm, bw, overhead, f"calibrated on {device.type} ({dtype}, "
                        f"{threads} threads)", dims, rates, max(transpose, 1.0), max(gather, 1.0))
    for _ in range(RETRIES):  # time the implausible points again, keeping each one's best
        bad = model.implausible_rates()
        if not bad:
            break
        index = {p: j for j, p in enumerate(model.grid_points())}
        better = list(model.gemm_rates)
        for p in bad:
            j = index[(p.m, p.n, p.k)]
            better[j] = max(better[j], gemm_rate_of(p.m, p.n, p.k, device, dtype, sync,
                                                    overhead, repeats=5))
        model = replace(model, gemm_rates=tuple(better))
    check_calibration(model, square(), threads)
    return model


def check_calibration(model: DeviceModel, square_again: float, threads: int = 1) -> None:
    """A :class:`~tncomp.errors.CalibrationError` (saying nothing was saved, and what to do)
    when ``model``'s measurements are implausible: a rate of its table is still implausible
    (:meth:`~tncomp.compiler.device_model.DeviceModel.implausible_rates`) after its retries, or
    the square GEMM's rate timed again at the end (``square_again``) differs from
    ``model.gemm_flops_per_s`` by more than :data:`SQUARE_SPREAD` times.
    ``threads``: what it was measured at (the message advises fewer when above 1)."""
    gemm = model.gemm_flops_per_s
    advice = ("nothing saved; run it again when the machine is idle"
              + (", or with fewer threads (--threads 1)" if threads > 1 else ""))
    bad = model.implausible_rates()
    if bad:
        raise CalibrationError(
            f"{len(bad)} of {len(model.gemm_rates)} GEMM shapes ran implausibly slowly against "
            f"the square GEMM's {gemm / 1e9:.3g} GFLOP/s, each timed {RETRIES + 1} times "
            f"(worst: {bad[0]}; {model.source}): other work held the cores; {advice}.")
    if not (_positive(square_again) and max(gemm, square_again)
            <= SQUARE_SPREAD * min(gemm, square_again)):
        raise CalibrationError(
            f"the square GEMM ran at {gemm / 1e9:.3g} GFLOP/s at the start of the calibration "
            f"and at {square_again / 1e9:.3g} GFLOP/s at its end ({model.source}): other work "
            f"took the cores meanwhile, so no rate measured here can be trusted; {advice}.")


def _positive(value: object) -> bool:
    """A finite number above 0 (an int too large for a float is not)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:  # an int beyond a float's range
        return False

