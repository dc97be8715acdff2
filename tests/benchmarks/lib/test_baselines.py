"""Correctness of the benchmark baselines against a dense TT reconstruction (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.lib.baselines import (
    Baseline,
    all_core_baselines,
    dense_linear,
    make_cores,
    tensorly_torch_tt,
    tt_to_dense,
)

DTYPE = torch.float64
BATCH = 5

CASES = {
    "d1": ((4,), (3,), (1, 3, 1)),
    "d2": ((2, 3), (3, 2), (1, 2, 3, 2, 1)),
    "d3": ((2, 3, 2), (2, 2, 3), (1, 2, 3, 4, 3, 2, 1)),
}


def _inputs(n_in: int, n_out: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, n_in, generator=gen, dtype=DTYPE)
    dy = torch.randn(BATCH, n_out, generator=gen, dtype=DTYPE)
    return x, dy


def test_tt_to_dense_matches_entrywise_definition() -> None:
    in_modes, out_modes, ranks = CASES["d2"]
    cores = make_cores(in_modes, out_modes, ranks, dtype=DTYPE)
    w = tt_to_dense(cores)
    assert w.shape == (6, 6)
    (i1, i2), (o1, o2) = (1, 2), (2, 0)
    entry = cores[0][:, i1, :] @ cores[1][:, i2, :] @ cores[2][:, o1, :] @ cores[3][:, o2, :]
    torch.testing.assert_close(w[i1 * 3 + i2, o1 * 2 + o2], entry.reshape(()))


def test_make_cores_shapes_and_scale() -> None:
    in_modes, out_modes, ranks = (4, 4, 4), (4, 4, 4), (1, 4, 4, 4, 4, 4, 1)
    cores = make_cores(in_modes, out_modes, ranks, seed=3)
    modes = in_modes + out_modes
    assert [tuple(c.shape) for c in cores] == [(ranks[k], modes[k], ranks[k + 1]) for k in range(6)]
    assert all(c.is_leaf and c.requires_grad and c.dtype == torch.float32 for c in cores)
    var = tt_to_dense(cores).detach().var().item()
    assert 0.25 < var * (64 + 64) < 4.0
    again = make_cores(in_modes, out_modes, ranks, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(cores, again, strict=True))


@pytest.mark.parametrize("case", sorted(CASES))
def test_core_baselines_match_dense_reference(case: str) -> None:
    in_modes, out_modes, ranks = CASES[case]
    cores = make_cores(in_modes, out_modes, ranks, dtype=DTYPE, seed=0)
    n_in, n_out = math.prod(in_modes), math.prod(out_modes)
    x0, dy = _inputs(n_in, n_out)

    x_ref = x0.clone().requires_grad_(True)
    y_ref = x_ref @ tt_to_dense(cores)
    grads_ref = torch.autograd.grad(y_ref, [x_ref, *cores], dy)

    baselines = all_core_baselines(cores, in_modes, out_modes, BATCH)
    assert [b.name for b in baselines] == [
        "naive_core_by_core",
        "opt_einsum_optimal",
        "hand_derived_comera",
    ]
    for baseline in baselines:
        baseline.zero_grad()
        x = x0.clone().requires_grad_(True)
        y = baseline.run(x, dy)
        assert y.shape == (BATCH, n_out), baseline.name
        torch.testing.assert_close(y, y_ref.detach(), msg=baseline.name)
        torch.testing.assert_close(x.grad, grads_ref[0], msg=baseline.name)
        assert len(baseline.params) == len(cores)
        for k, (core, g_ref) in enumerate(zip(cores, grads_ref[1:], strict=True)):
            assert baseline.params[k] is core
            torch.testing.assert_close(core.grad, g_ref, msg=f"{baseline.name} core {k}")
        assert baseline.num_params == sum(c.numel() for c in cores)


def test_hand_derived_skips_unneeded_grads() -> None:
    in_modes, out_modes, ranks = CASES["d2"]
    cores = [c.detach() for c in make_cores(in_modes, out_modes, ranks, dtype=DTYPE)]
    baseline = all_core_baselines(cores, in_modes, out_modes, BATCH)[-1]
    x, dy = _inputs(6, 6)
    x.requires_grad_(True)
    baseline.run(x, dy)
    torch.testing.assert_close(x.grad, dy @ tt_to_dense(cores).T)


def test_dense_linear() -> None:
    baseline = dense_linear(6, 4, dtype=DTYPE)
    assert isinstance(baseline, Baseline)
    assert baseline.module is not None
    weight = baseline.module.weight
    assert weight.shape == (4, 6)
    assert baseline.num_params == 24
    x, dy = _inputs(6, 4)
    x.requires_grad_(True)
    y = baseline.run(x, dy)
    torch.testing.assert_close(y, x.detach() @ weight.detach().T)
    torch.testing.assert_close(x.grad, dy @ weight.detach())
    torch.testing.assert_close(weight.grad, dy.T @ x.detach())


@pytest.mark.parametrize("case", sorted(CASES))
def test_tensorly_torch_tt(case: str) -> None:
    in_modes, out_modes, _ = CASES[case]
    n_in, n_out = math.prod(in_modes), math.prod(out_modes)
    baseline = tensorly_torch_tt(in_modes, out_modes, rank=3, dtype=DTYPE)
    assert baseline.module is not None
    assert "BlockTT" in baseline.description
    assert f"{baseline.num_params} params" in baseline.description
    x, dy = _inputs(n_in, n_out)
    x.requires_grad_(True)
    y = baseline.run(x, dy)
    weight = baseline.module.weight.to_matrix().detach()  # (N_out, N_in)
    assert weight.shape == (n_out, n_in)
    torch.testing.assert_close(y, x.detach() @ weight.T)
    torch.testing.assert_close(x.grad, dy @ weight)
    assert all(p.grad is not None for p in baseline.params)
