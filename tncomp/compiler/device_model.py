"""A device cost model: GEMM rate, memory bandwidth and a fixed cost per step.

FLOP-optimal is not time-optimal: a permute copy or a thin GEMM costs bandwidth, and every step
costs dispatch time. Plans are scored by ``sum(max(flops / rate, bytes / bandwidth) + overhead)``;
the *floor* of a plan drops the per-step overhead. ``tncomp.runtime.calibrate`` measures the
numbers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DeviceModel:
    """Rates of one device and dtype, measured or assumed."""

    gemm_flops_per_s: float = 100e9
    bytes_per_s: float = 10e9
    step_overhead_s: float = 6e-6
    source: str = "default (not calibrated)"

    def op_time(self, flops: float, nbytes: float) -> float:
        """Modelled seconds of one step: FLOPs at the GEMM rate or bytes at bandwidth, whichever is
        slower, plus the per-step overhead."""
        return max(flops / self.gemm_flops_per_s, nbytes / self.bytes_per_s) + self.step_overhead_s

    def floor_time(self, flops: float, nbytes: float) -> float:
        """:meth:`op_time` without the per-step overhead: the step's rate-limited lower bound."""
        return max(flops / self.gemm_flops_per_s, nbytes / self.bytes_per_s)


CPU_DEFAULT = DeviceModel()
CUDA_DEFAULT = DeviceModel(50e12, 2e12, 8e-6, "default CUDA (not calibrated)")
