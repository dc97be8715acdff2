"""Measure a device's GEMM rate and memory bandwidth once, and keep them on disk."""

from __future__ import annotations

import json
import time

import torch

from tncomp.cache import default_cache_dir
from tncomp.model import DeviceModel


def _path(device: torch.device):
    return default_cache_dir() / f"calibration-{device.type}.json"


def load_calibration(device: torch.device) -> DeviceModel | None:
    try:
        data = json.loads(_path(device).read_text())
        return DeviceModel(**data)
    except (OSError, ValueError, TypeError):
        return None


def median_time(fn, repeats: int, sync) -> float:
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
    a = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty_like(a)
    gemm = 2 * n**3 / median_time(lambda: torch.mm(a, a, out=out), 5, sync)
    big = torch.empty(32 * 2**20 // 4, device=device, dtype=torch.float32).normal_()
    dst = torch.empty_like(big)
    bw = 2 * big.numel() * 4 / median_time(lambda: dst.copy_(big), 7, sync)
    tiny = torch.randn(4, 4, device=device, dtype=dtype)
    overhead = median_time(lambda: torch.mm(tiny, tiny), 50, sync)
    model = DeviceModel(gemm, bw, overhead, f"calibrated on {device.type} ({dtype})")
    if save:
        path = _path(device)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"gemm_flops_per_s": gemm, "bytes_per_s": bw,
                                    "step_overhead_s": overhead, "source": model.source}))
    return model
