"""The shape-aware GEMM rate of the device model: interpolation of a measured (m, n, k) table,
its use in plan times, and its validation."""

from __future__ import annotations

import math

import pytest

import tncomp
from tncomp.compiler.device_model import DeviceModel
from tncomp.compiler.ops import MatMul, MatView, Permute
from tncomp.compiler.plan import lower
from tncomp.compiler.problem import problem_for
from tncomp.compiler.search import candidate_trees

GRID = (8, 64, 512)


def _table(rate) -> tuple[float, ...]:
    """Rates of ``rate(m, n, k)`` on GRID, m-major (the DeviceModel layout)."""
    return tuple(rate(m, n, k) for m in GRID for n in GRID for k in GRID)


def _thin_slow(m: int, n: int, k: int) -> float:
    return 1e9 * min(m, n, k)  # 8 GFLOP/s at a size 8, 512 GFLOP/s square 512


MODEL = DeviceModel(500e9, 10e9, 5e-6, "test", GRID, _table(_thin_slow))


def test_without_a_table_every_gemm_runs_at_the_flat_rate():
    flat = DeviceModel(100e9, 10e9, 6e-6)
    assert flat.gemm_rate(4096, 30, 768) == flat.gemm_rate(8, 8, 8) == 100e9
    op = MatMul(2, MatView(0, (4096, 768), False), MatView(1, (768, 30), False),
                2 * 4096 * 768 * 30, 4 * (4096 * 768 + 768 * 30 + 4096 * 30))
    assert flat.step_time(op) == flat.op_time(op.flops, op.nbytes)
    assert flat.step_floor(op) == flat.floor_time(op.flops, op.nbytes)


def test_the_table_is_exact_on_the_grid_and_log_linear_between():
    for m, n, k in ((8, 64, 512), (512, 512, 512), (64, 8, 64)):
        assert MODEL.gemm_rate(m, n, k) == pytest.approx(_thin_slow(m, n, k))
    # halfway in log size between 8 and 64 (size 8 * sqrt(8)): the geometric mean of the rates
    mid = round(8 * math.sqrt(8))
    expected = math.exp(0.5 * math.log(8e9) + 0.5 * math.log(64e9))
    t = math.log(mid / 8) / math.log(8)
    assert MODEL.gemm_rate(mid, 512, 512) == pytest.approx(
        math.exp((1 - t) * math.log(8e9) + t * math.log(64e9)))
    assert MODEL.gemm_rate(mid, 512, 512) == pytest.approx(expected, rel=0.05)
    # outside the grid: clamped to its ends; an output side past the grid is folded into the
    # other side (the output keeps its size: 4096 x 64 reads as 512 x 512)
    assert MODEL.gemm_rate(2, 512, 512) == pytest.approx(8e9)
    assert MODEL.gemm_rate(4096, 4096, 4096) == pytest.approx(512e9)
    assert MODEL.gemm_rate(4096, 64, 512) == pytest.approx(512e9)
    assert MODEL.gemm_rate(64, 4096, 512) == pytest.approx(512e9)


def test_a_thin_gemm_costs_more_than_its_flops_at_peak():
    thin = MatMul(2, MatView(0, (512, 512), False), MatView(1, (512, 8), False),
                  2 * 512 * 512 * 8, 0)
    square = MatMul(2, MatView(0, (512, 512), False), MatView(1, (512, 512), False),
                    2 * 512**3, 0)
    assert MODEL.step_floor(thin) == pytest.approx(thin.flops / 8e9)
    assert MODEL.step_floor(square) == pytest.approx(square.flops / 512e9)
    assert MODEL.step_time(thin) == pytest.approx(MODEL.step_floor(thin) + 5e-6)
    # a batched GEMM counts its batch as rows; other steps keep the bandwidth model
    bmm = MatMul(2, MatView(0, (8, 64, 512), False), MatView(1, (8, 512, 512), False),
                 2 * 8 * 64 * 512 * 512, 0)
    assert MODEL.step_floor(bmm) == pytest.approx(bmm.flops / 512e9)
    copy = Permute(3, 2, (64, 64), (1, 0), 2 * 64 * 64 * 4)
    assert MODEL.step_floor(copy) == MODEL.floor_time(0, copy.nbytes)


def test_plan_times_use_the_shape_of_each_gemm():
    net = tncomp.tt_linear((8, 8), (8, 8), 8)
    problem = problem_for(net, {"b": 512})
    tree = next(iter(candidate_trees(problem)))
    plan = lower(problem, tree, (True,) * 5, 4, swaps=[False] * len(tree.steps))
    flat = DeviceModel(500e9, 10e9, 5e-6)
    assert plan.floor_time(MODEL) == pytest.approx(sum(MODEL.step_floor(op) for op in (
        *plan.forward, *plan.backward)))
    assert plan.floor_time(MODEL) > plan.floor_time(flat)  # rank-8 GEMMs run below peak
    assert plan.modelled_time(MODEL) > plan.floor_time(MODEL)


@pytest.mark.parametrize("dims, rates", [
    ((8, 64), (1e9,) * 7),  # 7 rates for 2 sizes: needs 8
    ((64, 8), (1e9,) * 8),  # not ascending
    ((), (1e9,)),
])
def test_a_malformed_table_is_refused(dims, rates):
    with pytest.raises(ValueError, match=r"len\(gemm_dims\) \*\* 3"):
        DeviceModel(1e9, 1e9, 1e-6, "bad", dims, rates)


def test_a_model_with_a_table_round_trips_through_the_calibration_file(tmp_path, monkeypatch):
    from tncomp.runtime.device_timing import load_calibration, save_calibration

    monkeypatch.setenv("TNCOMP_CACHE_DIR", str(tmp_path))
    save_calibration(MODEL, "cpu")
    assert load_calibration("cpu") == MODEL
    (tmp_path / "calibration-cpu.json").write_text(
        '{"gemm_flops_per_s": 1e9, "bytes_per_s": 1e9, "step_overhead_s": 1e-6, '
        '"gemm_dims": [8, 64], "gemm_rates": [1e9, 1e9]}')
    assert load_calibration("cpu") is None  # a table of the wrong length is ignored


# -- issue 42, item 7: a thin GEMM is slower per FLOP, but not 10,000 times ---------------------

def test_a_thin_gemm_far_slower_than_the_square_rate_predicts_is_implausible():
    from tncomp.compiler.device_model import PLAUSIBLE_SLOWDOWN

    assert MODEL.implausible_rates() == []  # 64x slower per FLOP at size 8, yet plausible:
    # its time is FLOPs at the square rate plus the per-step overhead, which the 8^3 GEMM is
    busy = list(MODEL.gemm_rates)
    busy[GRID.index(8) * 9 + GRID.index(64) * 3 + GRID.index(8)] = 1e6  # 1 MFLOP/s at 8x64x8
    flops = 2 * 8 * 64 * 8
    slowdown = (flops / 1e6) / (flops / MODEL.gemm_flops_per_s + MODEL.step_overhead_s)
    model = DeviceModel(500e9, 10e9, 5e-6, "busy", GRID, tuple(busy))
    (bad,) = model.implausible_rates()
    assert (bad.m, bad.n, bad.k, bad.rate) == (8, 64, 8, 1e6)
    assert bad.slowdown == pytest.approx(slowdown) and bad.slowdown > PLAUSIBLE_SLOWDOWN
    assert str(bad) == f"(8x8)@(8x64) at 1 MFLOP/s, {slowdown:.0f}x slower than the square " \
                       "GEMM's rate predicts"
    # just within the bound: plausible
    edge = list(MODEL.gemm_rates)
    time = PLAUSIBLE_SLOWDOWN * 0.99 * (flops / MODEL.gemm_flops_per_s + MODEL.step_overhead_s)
    edge[GRID.index(8) * 9 + GRID.index(64) * 3 + GRID.index(8)] = flops / time
    assert DeviceModel(500e9, 10e9, 5e-6, "edge", GRID, tuple(edge)).implausible_rates() == []
    assert DeviceModel().implausible_rates() == []  # no table: nothing to doubt
