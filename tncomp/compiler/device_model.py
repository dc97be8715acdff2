"""A device cost model: GEMM rates, memory bandwidth and a fixed cost per step.

FLOP-optimal is not time-optimal: a permute copy or a thin GEMM costs bandwidth, and every step
costs dispatch time. Plans are scored by ``sum(max(flops / rate, bytes / bandwidth) + overhead)``,
a permute copy's bandwidth slowed by how it reads (a transpose, or a gather of short runs: no
CPU copy of those runs near a plain copy's speed). The *floor* of a step is its roofline:
``max(flops / rate, bytes / bandwidth)``, the rate of its GEMM shape when the model has a table,
with no overhead and no slowdown. ``tncomp.runtime.device_timing`` measures the numbers.

The GEMM rate depends on the shape: a thin GEMM (an inner or outer size of 8-64, the TT rank)
runs well below the rate of a large square one (figures in docs/results.md). A calibrated model
therefore carries a table of measured rates on a grid of ``(m, n, k)`` and interpolates it in log
space (:meth:`DeviceModel.gemm_rate`); without a table every GEMM runs at ``gemm_flops_per_s``.

A thin GEMM is slower per FLOP, but not without bound: one that takes more than
:data:`PLAUSIBLE_SLOWDOWN` times what the square rate and the per-step overhead predict was
measured while other work held the cores (:meth:`DeviceModel.implausible_rates`), and a
calibration holding such a rate is refused rather than planned with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tncomp.compiler.ops import MatMul, Op, Permute

__all__ = ["CPU_DEFAULT", "CUDA_DEFAULT", "PLAUSIBLE_SLOWDOWN", "SLOW_COPY_BYTES", "DeviceModel",
           "ImplausibleRate"]

SLOW_COPY_BYTES = 1 << 20  # a copy moving more than this leaves the cache: its kind slows it
PLAUSIBLE_SLOWDOWN = 50.0  # a GEMM this many times slower than the square rate predicts is noise


@dataclass(frozen=True, slots=True)
class ImplausibleRate:
    """A grid point of a GEMM table that ran ``slowdown`` times slower than the square GEMM's
    rate and the per-step overhead predict (:meth:`DeviceModel.implausible_rates`)."""

    m: int
    n: int
    k: int
    rate: float  # FLOP/s as measured
    slowdown: float  # measured seconds / (FLOPs / square rate + per-step overhead)

    def __str__(self) -> str:
        return (f"({self.m}x{self.k})@({self.k}x{self.n}) at {self.rate / 1e6:.3g} MFLOP/s, "
                f"{self.slowdown:.0f}x slower than the square GEMM's rate predicts")


@dataclass(frozen=True, slots=True)
class DeviceModel:
    """Rates of one device and dtype, measured or assumed.

    ``gemm_dims`` (ascending) is the grid of sizes the rates were measured at, the same for m,
    n and k; ``gemm_rates[(a * d + b) * d + c]`` (``d = len(gemm_dims)``) is the FLOP/s of an
    ``(m x k) @ (k x n)`` GEMM with ``m, n, k = gemm_dims[a], gemm_dims[b], gemm_dims[c]``.
    Both empty: no table (every GEMM at ``gemm_flops_per_s``)."""

    gemm_flops_per_s: float = 100e9
    bytes_per_s: float = 10e9
    step_overhead_s: float = 6e-6
    source: str = "default (not calibrated)"
    gemm_dims: tuple[int, ...] = ()
    gemm_rates: tuple[float, ...] = ()
    transpose_slowdown: float = 6.0  # a blocked 2-D transpose against a plain copy
    gather_slowdown: float = 30.0  # a copy of short runs read far apart against a plain copy

    def __post_init__(self) -> None:
        d = len(self.gemm_dims)
        if len(self.gemm_rates) != d**3 or list(self.gemm_dims) != sorted(set(self.gemm_dims)):
            raise ValueError(
                f"gemm_rates holds {len(self.gemm_rates)} rates for {d} grid sizes "
                f"{self.gemm_dims}; it needs len(gemm_dims) ** 3 = {d**3}, with gemm_dims "
                "strictly ascending (or both empty).")

    def gemm_rate(self, m: int, n: int, k: int) -> float:
        """FLOP/s of an ``(m x k) @ (k x n)`` GEMM: the table interpolated linearly in
        ``log(size)`` and ``log(rate)`` (sizes outside the grid are clamped to its ends, an
        output side past it folded into the other side), or ``gemm_flops_per_s`` without a
        table."""
        if not self.gemm_dims:
            return self.gemm_flops_per_s
        d, top = len(self.gemm_dims), self.gemm_dims[-1]
        # An output side past the grid is folded into the other one, keeping the output's size:
        # a thin GEMM's rate drops once its output leaves the cache (docs/results.md).
        if m > top:
            m, n = top, n * m / top
        if n > top:
            m, n = min(top, m * n / top), top
        corners = [_bracket(self.gemm_dims, x) for x in (m, n, k)]
        log_rate = 0.0
        for a, wa in corners[0]:
            for b, wb in corners[1]:
                for c, wc in corners[2]:
                    w = wa * wb * wc
                    if w:
                        log_rate += w * math.log(self.gemm_rates[(a * d + b) * d + c])
        return math.exp(log_rate)

    def grid_points(self) -> list[tuple[int, int, int]]:
        """The ``(m, n, k)`` of each rate of the table, in ``gemm_rates`` order (m-major)."""
        dims = self.gemm_dims
        return [(m, n, k) for m in dims for n in dims for k in dims]

    def implausible_rates(self, limit: float = PLAUSIBLE_SLOWDOWN) -> list[ImplausibleRate]:
        """The table's rates whose GEMM took more than ``limit`` times the seconds the square
        rate and the per-step overhead predict (``FLOPs / gemm_flops_per_s +
        step_overhead_s``), worst first: rates measured while something else held the cores.
        A thin GEMM is slower per FLOP than a square one, but within this bound."""
        found = []
        for (m, n, k), rate in zip(self.grid_points(), self.gemm_rates, strict=True):
            flops = 2 * m * n * k
            slowdown = (flops / rate) / (flops / self.gemm_flops_per_s + self.step_overhead_s)
            if slowdown > limit:
                found.append(ImplausibleRate(m, n, k, rate, slowdown))
        return sorted(found, key=lambda p: -p.slowdown)

    def matmul_time(self, m: int, n: int, k: int, batch: int = 1, nbytes: float = 0.0) -> float:
        """Modelled seconds of ``batch`` GEMMs ``(m x k) @ (k x n)`` moving ``nbytes``: the
        FLOPs at the rate of their shape (a batch counts as ``batch * m`` rows) or the bytes at
        bandwidth, whichever is slower, plus the per-step overhead."""
        return self.matmul_floor(m, n, k, batch, nbytes) + self.step_overhead_s

    def matmul_floor(self, m: int, n: int, k: int, batch: int = 1, nbytes: float = 0.0) -> float:
        """:meth:`matmul_time` without the per-step overhead."""
        flops = 2 * batch * m * n * k
        return max(flops / self.gemm_rate(batch * m, n, k), nbytes / self.bytes_per_s)

    def op_time(self, flops: float, nbytes: float) -> float:
        """Modelled seconds of one step: FLOPs at the GEMM rate or bytes at bandwidth, whichever is
        slower, plus the per-step overhead."""
        return max(flops / self.gemm_flops_per_s, nbytes / self.bytes_per_s) + self.step_overhead_s

    def floor_time(self, flops: float, nbytes: float) -> float:
        """:meth:`op_time` without the per-step overhead: the step's rate-limited lower bound."""
        return max(flops / self.gemm_flops_per_s, nbytes / self.bytes_per_s)

    def step_time(self, op: Op) -> float:
        """Modelled seconds of one plan step: a GEMM at the rate of its shape
        (:meth:`matmul_time`), a permute copy at bandwidth slowed by its kind
        (:attr:`~tncomp.compiler.ops.Permute.kind`: ``transpose_slowdown``,
        ``gather_slowdown``; a copy of at most :data:`SLOW_COPY_BYTES`, in cache, at bandwidth),
        any other step by :meth:`op_time`."""
        floor = self.step_floor(op)
        if isinstance(op, Permute) and op.nbytes > SLOW_COPY_BYTES:
            kind = op.kind
            floor *= (self.transpose_slowdown if kind == "transpose" else
                      self.gather_slowdown if kind == "gather" else 1.0)
        return floor + self.step_overhead_s

    def step_floor(self, op: Op) -> float:
        """:meth:`step_time` without the per-step overhead."""
        if isinstance(op, MatMul) and self.gemm_dims:
            m, k = op.lhs.rows_cols
            n = op.rhs.rows_cols[1]
            batch = op.lhs.batch
            return self.matmul_floor(m, n, k, batch, op.nbytes)
        return self.floor_time(op.flops, op.nbytes)


def _bracket(grid: tuple[int, ...], x: float) -> tuple[tuple[int, float], tuple[int, float]]:
    """The two grid positions around ``x`` and their weights (linear in log size)."""
    if x <= grid[0]:
        return (0, 1.0), (0, 0.0)
    if x >= grid[-1]:
        last = len(grid) - 1
        return (last, 1.0), (last, 0.0)
    hi = next(j for j, g in enumerate(grid) if g >= x)
    lo = hi - 1
    t = math.log(x / grid[lo]) / math.log(grid[hi] / grid[lo])
    return (lo, 1.0 - t), (hi, t)


CPU_DEFAULT = DeviceModel()
CUDA_DEFAULT = DeviceModel(50e12, 2e12, 8e-6, "default CUDA (not calibrated)",
                           transpose_slowdown=2.0, gather_slowdown=4.0)
