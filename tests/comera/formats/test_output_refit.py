"""The closed-form refit of the output-side cores: each solve is the exact least-squares optimum
of the output error (checked against a brute-force float64 lstsq on the inputs themselves), and
a refit never raises the output error on the calibration inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import comera
from comera.formats.registry import get_format
from comera.formats.whitened import (
    damped,
    output_cores,
    output_error,
    refit_output_cores,
    solve_output_core,
)

F64 = torch.float64
CASES = [("lowrank", (12,), (10,)), ("tt", (3, 4), (2, 5)), ("tt", (2, 2, 3), (3, 2, 2)),
         ("tucker", (3, 4), (2, 5))]


def _problem(fmt_name, in_modes, out_modes, rows=40, seed=0):
    torch.manual_seed(seed)
    layout = get_format(fmt_name).layout(in_modes, out_modes, 3)
    n_in, n_out = layout.in_features, layout.out_features
    x = torch.randn(rows, n_in, dtype=F64) @ torch.randn(n_in, n_in, dtype=F64)  # correlated
    w = torch.randn(n_in, n_out, dtype=F64)
    cores = [torch.randn(s, dtype=F64) for s in layout.core_shapes]
    return layout, x, w, cores


def test_which_cores_are_refitted():
    assert output_cores(get_format("lowrank").layout((12,), (10,), 3)) == (1,)
    assert output_cores(get_format("tt").layout((3, 4), (2, 5), 3)) == (2, 3)
    assert output_cores(get_format("tucker").layout((3, 4), (2, 5), 3)) == (2, 3, 4)
    assert output_cores(get_format("ttm").layout((3, 4), (2, 5), 3)) == ()  # inputs on all
    assert output_cores(get_format("btt").layout((3, 4), (2, 5), 3)) == ()


@pytest.mark.parametrize(("fmt", "in_modes", "out_modes"), CASES)
def test_each_solve_is_the_brute_force_least_squares_optimum(fmt, in_modes, out_modes):
    layout, x, w, cores = _problem(fmt, in_modes, out_modes)
    gram = x.T @ x
    for k in output_cores(layout):
        solved = solve_output_core(cores, k, layout, w, gram)

        def outputs(core, k=k):  # X Ŵ(core k): linear in the core
            return x @ layout.dense([*cores[:k], core, *cores[k + 1:]])

        jac = torch.autograd.functional.jacobian(outputs, cores[k])  # (rows, out, *core)
        brute = torch.linalg.lstsq(jac.reshape(-1, cores[k].numel()),
                                   (x @ w).reshape(-1)).solution.reshape(cores[k].shape)
        assert torch.allclose(solved, brute, atol=1e-8, rtol=1e-8), (fmt, k)


def test_lowrank_solve_is_svd_llms_update():
    layout, x, w, (a, b) = _problem("lowrank", (12,), (10,))
    gram = x.T @ x
    expected = torch.linalg.solve(a.T @ gram @ a, a.T @ gram @ w)  # (A^T C A)^-1 A^T C W
    assert torch.allclose(solve_output_core([a, b], 1, layout, w, gram), expected, atol=1e-9)


@pytest.mark.parametrize(("fmt", "in_modes", "out_modes"), CASES)
@pytest.mark.parametrize("rows", [5, 60])  # a singular gram (5 rows < in) and a full one
def test_refit_never_raises_the_output_error(fmt, in_modes, out_modes, rows):
    layout, x, w, cores = _problem(fmt, in_modes, out_modes, rows=rows, seed=rows)
    gram = x.T @ x / rows
    starts = {"random": cores, "plain": get_format(fmt).decompose(w, layout),
              "calibrated": get_format(fmt).decompose(w, layout, damped(gram, 1e-2))}
    for name, start in starts.items():
        before = output_error(w, layout.dense(start), gram)
        refitted = refit_output_cores(start, layout, w, gram)
        after = output_error(w, layout.dense(refitted), gram)
        assert after <= before, (fmt, name)
        if name == "random":
            assert after < 0.9 * before, (fmt, name)  # a random start is far from optimal


def test_an_environment_over_the_cap_is_left_alone():
    layout, x, w, cores = _problem("tucker", (3, 4), (2, 5))
    refitted = refit_output_cores(cores, layout, w, x.T @ x, max_entries=1)
    assert all(torch.equal(a, b) for a, b in zip(refitted, cores, strict=True))


def _mlp():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(16, 24, dtype=F64), nn.Tanh(), nn.Linear(24, 12, dtype=F64))


@pytest.mark.parametrize("fmt", ["lowrank", "tt", "tucker", "ttm"])
def test_convert_with_refit_lowers_no_layers_output_error(fmt):
    torch.manual_seed(4)
    batches = [torch.randn(32, 16, dtype=F64) @ torch.randn(16, 16, dtype=F64)
               for _ in range(3)]
    options = {"format": fmt, "target_compression": 2.5}
    plain, refit = _mlp(), _mlp()
    base = comera.convert_(plain, calibration=batches, **options)
    fitted = comera.convert_(refit, calibration=batches, closed_form_refit=True, **options)
    for a, b in zip(base.layers, fitted.layers, strict=True):
        assert a.ranks == b.ranks and a.after == b.after
        assert b.error <= a.error + 1e-12, (fmt, a.name, a.error, b.error)
    if fmt == "ttm":  # no output-side core: the conversion is unchanged
        assert all(torch.equal(p, q) for p, q in zip(plain.state_dict().values(),
                                                     refit.state_dict().values(), strict=True))


def test_convert_refit_needs_calibration():
    with pytest.raises(comera.errors.ConfigError, match="closed_form_refit=True"):
        comera.convert_(_mlp(), format="lowrank", target_compression=2, closed_form_refit=True)
