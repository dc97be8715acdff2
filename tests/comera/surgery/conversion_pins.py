"""The conversions test_conversion_pins.py pins: a small MLP converted to every format that has
a decomposition, plain and calibrated, at a uniform rank, a uniform target and a global budget.

The pinned file (data/conversion_pins.pt) was written with main's conversion code of d5d1e18,
before the formats owned their calibration, so the test proves the refactor changed no core,
bias, gate, rank, layer class or reported error bit. Regenerate (only on purpose) with

    PYTHONPATH=$PWD python tests/comera/surgery/conversion_pins.py
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import torch
from torch import nn

import comera
from comera.surgery.config import ConvertConfig

PINS = Path(__file__).parent / "data" / "conversion_pins.pt"
FORMATS = ("tt", "ttm", "tucker", "cp", "lowrank", "tr", "btt")
WITH_SPECTRA = ("tt", "ttm", "tucker", "lowrank")


def cases() -> dict[str, tuple[str, dict, bool]]:
    """name -> (format, ConvertConfig options, calibrated)."""
    out = {}
    for fmt in FORMATS:
        for calibrated in (False, True):
            tag = "cal" if calibrated else "plain"
            out[f"{fmt}-rank-{tag}"] = (fmt, {"ranks": 3}, calibrated)
            out[f"{fmt}-target-{tag}"] = (fmt, {"target_compression": 2.5}, calibrated)
            if fmt in WITH_SPECTRA:
                out[f"{fmt}-global-{tag}"] = (fmt, {"target_compression": 2.5,
                                                    "allocation": "global"}, calibrated)
    out["tt-balanced-cal"] = ("tt", {"ranks": 3, "parametrization": "balanced"}, True)
    return out


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 32), nn.Tanh(), nn.Linear(32, 24))


def inputs() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    basis, _ = torch.linalg.qr(torch.randn(24, 24, generator=gen))
    return (torch.randn(256, 24, generator=gen) * torch.logspace(0, -2, 24)) @ basis.T


def convert(fmt: str, options: dict, calibrated: bool) -> dict:
    """The converted model's state dict, layer classes, ranks and reported errors."""
    net = copy.deepcopy(model())
    x = inputs()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the LAPACK calls are then deterministic
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = comera.convert_(net, ConvertConfig(format=fmt, **options),
                                     calibration=list(x.split(128)) if calibrated else None)
    finally:
        torch.set_num_threads(threads)
    return {"state": {k: v.clone() for k, v in net.state_dict().items()},
            "classes": [type(m).__name__ for m in net],
            "ranks": [list(layer.ranks) for layer in report.layers],
            "errors": [layer.error for layer in report.layers],
            "calibrated": [layer.calibrated for layer in report.layers]}


if __name__ == "__main__":
    torch.save({name: convert(*case) for name, case in cases().items()}, PINS)
    print(f"wrote {PINS} ({PINS.stat().st_size:,} bytes)")
