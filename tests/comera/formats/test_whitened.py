"""Calibrated decompositions (comera/formats/whitened.py): on a synthetic layer with skewed,
correlated inputs, every calibrating format's output error is below its plain decomposition's
at a truncating rank and zero at full rank (float64); low-rank reaches the Eckart-Young optimum
of the whitened weight; the refit never raises the error; the bond spectra are the unfoldings'
singular values."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from comera.errors import ConfigError
from comera.formats.registry import format_names, get_format
from comera.formats.whitened import (
    calibrated_decomposition,
    check_gram,
    damped,
    mode_grams,
    output_error,
    refit,
    whitening,
)

F64 = torch.float64
IN, OUT = 24, 30  # 24 = 2*3*4, 30 = 2*3*5
MODES = {"lowrank": ((IN,), (OUT,)), "tt": ((2, 3, 4), (2, 3, 5)), "ttm": ((2, 3, 4), (2, 3, 5)),
         "tucker": ((2, 3, 4), (2, 3, 5)), "tr": ((2, 3, 4), (2, 3, 5)),
         "btt": ((2, 3, 4), (2, 3, 5)), "cp": ((2, 3, 4), (2, 3, 5))}
TRUNCATING = {"lowrank": 4, "tt": 3, "ttm": 3, "tucker": 2, "tr": 2, "btt": 2, "cp": 3}
CALIBRATING = [n for n in format_names() if get_format(n).calibrates]


def skewed_inputs(rows: int = 4000, seed: int = 0) -> torch.Tensor:
    """Inputs whose scales span three decades along random directions: what a trained layer's
    activations look like, far from the isotropic inputs a plain decomposition assumes."""
    gen = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(IN, IN, generator=gen, dtype=F64))
    scales = torch.logspace(0, -3, IN, dtype=F64)
    return (torch.randn(rows, IN, generator=gen, dtype=F64) * scales) @ basis.T


@pytest.fixture(scope="module")
def layer():
    gen = torch.Generator().manual_seed(1)
    x = skewed_inputs()
    weight = torch.randn(IN, OUT, generator=gen, dtype=F64) / math.sqrt(IN)
    return weight, x.T @ x / x.shape[0]


def _dense(fmt, cores, layout):
    sizes = {b: int(cores[c].shape[a]) for b, (c, a) in
             zip(layout.bonds, (layout.carriers(b)[0] for b in layout.bonds), strict=True)}
    return layout.resized(sizes).dense(cores)


def test_every_format_with_a_decomposition_calibrates():
    assert set(CALIBRATING) == set(MODES)


@pytest.mark.parametrize("name", sorted(MODES))
def test_calibrated_output_error_is_below_plain(layer, name):
    weight, gram = layer
    fmt = get_format(name)
    layout = fmt.layout(*MODES[name], TRUNCATING[name])
    plain = _dense(fmt, fmt.decompose(weight, layout), layout)
    calibrated = _dense(fmt, fmt.decompose(weight, layout, damped(gram, 1e-8)), layout)
    e_plain, e_cal = output_error(weight, plain, gram), output_error(weight, calibrated, gram)
    assert e_cal < 0.9 * e_plain, (e_cal, e_plain)
    # the plain decomposition minimises the weight error instead: it wins there
    assert (weight - plain).norm() <= (weight - calibrated).norm() * 1.0001


@pytest.mark.parametrize("name", sorted(n for n in MODES if get_format(n).exact_decomposition))
def test_exact_at_full_rank(layer, name):
    weight, gram = layer
    fmt = get_format(name)
    layout = fmt.layout(*MODES[name], 10**4)
    cores = fmt.decompose(weight, layout, damped(gram, 1e-2))
    torch.testing.assert_close(_dense(fmt, cores, layout), weight, rtol=1e-10, atol=1e-11)


def test_lowrank_reaches_the_whitened_eckart_young_optimum(layer):
    """SVD-LLM: the output error is the root of the whitened weight's discarded energies."""
    weight, gram = layer
    gram = damped(gram, 1e-10)
    fmt = get_format("lowrank")
    rank = 5
    layout = fmt.layout((IN,), (OUT,), rank)
    cores = fmt.decompose(weight, layout, gram)
    s = torch.linalg.svdvals(whitening(gram).T @ weight)
    expected = float(s[rank:].square().sum().sqrt())
    assert output_error(weight, layout.dense(cores), gram) == pytest.approx(expected, rel=1e-8)


@pytest.mark.parametrize("name", ["tt", "ttm", "tucker"])
def test_refit_never_raises_the_error(layer, name):
    weight, gram = layer
    fmt = get_format(name)
    layout = fmt.layout(*MODES[name], TRUNCATING[name])
    errors = [output_error(weight, _dense(fmt, calibrated_decomposition(
        fmt, weight, layout, gram, sweeps=s), layout), gram) for s in range(4)]
    assert all(b <= a * (1 + 1e-12) for a, b in itertools.pairwise(errors)), errors
    assert errors[-1] < errors[0]


def test_refit_keeps_an_exact_start_and_the_shapes(layer):
    weight, gram = layer
    fmt = get_format("tt")
    layout = fmt.layout(*MODES["tt"], 10**4)
    cores = fmt.decompose(weight, layout)
    again = refit(cores, layout, weight, gram)
    assert [c.shape for c in again] == [c.shape for c in cores]
    torch.testing.assert_close(layout.dense(again), weight, rtol=1e-10, atol=1e-11)


def test_refit_respects_its_work_budget(layer):
    weight, gram = layer
    fmt = get_format("tt")
    layout = fmt.layout(*MODES["tt"], 2)
    cores = fmt.decompose(weight, layout)
    same = refit(cores, layout, weight, gram, max_flops=1.0)  # not even one pass fits
    for a, b in zip(same, cores, strict=True):
        assert torch.equal(a, b)


def test_mode_grams_of_a_kronecker_product_are_its_factors():
    gen = torch.Generator().manual_seed(2)
    factors = []
    for n in (2, 3, 4):
        a = torch.randn(n, n, generator=gen, dtype=F64)
        factors.append(a @ a.T + torch.eye(n, dtype=F64))
    gram = torch.kron(torch.kron(factors[0], factors[1]), factors[2])
    for got, want in zip(mode_grams(gram, (2, 3, 4)), factors, strict=True):
        ratio = got / want
        torch.testing.assert_close(ratio, torch.full_like(ratio, float(ratio[0, 0])))


def test_damping_and_whitening():
    zero = torch.zeros(3, 3, dtype=F64)
    torch.testing.assert_close(damped(zero, 0.1), torch.eye(3, dtype=F64))
    singular = torch.ones(3, 3, dtype=F64)  # rank 1: no Cholesky factor without a jitter
    s = whitening(singular)
    assert torch.isfinite(s).all()
    torch.testing.assert_close(s @ s.T, singular, atol=1e-6, rtol=0)
    gram = damped(singular, 1e-2)
    torch.testing.assert_close(gram.diagonal(), torch.full((3,), 1.01, dtype=F64))


def test_check_gram_names_shape_and_non_finite_entries():
    with pytest.raises(ConfigError, match=r"shape \(3, 3\).*\(4, 4\)"):
        check_gram(torch.eye(3), 4)
    bad = torch.eye(4)
    bad[0, 1] = float("nan")
    with pytest.raises(ConfigError, match="NaN or infinite"):
        check_gram(bad, 4)
    with pytest.raises(ConfigError, match="gram"):
        get_format("lowrank").decompose(torch.randn(4, 5), get_format("lowrank").layout(
            (4,), (5,), 2), torch.eye(3))


def test_spectra_are_the_unfoldings_singular_values(layer):
    weight, _ = layer
    tt = get_format("tt")
    layout = tt.layout(*MODES["tt"], 3)
    spectra = tt.spectra(weight, layout)
    tensor = weight.reshape(2, 3, 4, 2, 3, 5)
    assert len(spectra) == len(layout.bonds) == 5
    for k, s in enumerate(spectra, 1):
        want = torch.linalg.svdvals(tensor.reshape(math.prod(tensor.shape[:k]), -1))
        torch.testing.assert_close(s, want)
    low = get_format("lowrank")
    (s,) = low.spectra(weight, low.layout((IN,), (OUT,), 3))
    torch.testing.assert_close(s, torch.linalg.svdvals(weight))
    ttm = get_format("ttm")
    assert len(ttm.spectra(weight, ttm.layout(*MODES["ttm"], 3))) == 2
    tucker = get_format("tucker")
    spectra = tucker.spectra(weight, tucker.layout(*MODES["tucker"], 2))
    assert [s.numel() for s in spectra] == [2, 3, 4, 2, 3, 5]
    for name in ("tr", "btt", "cp"):  # no spectra: global allocation refuses them
        fmt = get_format(name)
        assert fmt.spectra(weight, fmt.layout(*MODES["tt"], 2)) is None


def test_lowrank_truncation_error_is_the_discarded_spectrum(layer):
    weight, _ = layer
    fmt = get_format("lowrank")
    (s,) = fmt.spectra(weight, fmt.layout((IN,), (OUT,), 1))
    layout = fmt.layout((IN,), (OUT,), 6)
    approx = layout.dense(fmt.decompose(weight, layout))
    assert float((weight - approx).norm()) == pytest.approx(float(s[6:].norm()), rel=1e-10)


def test_tt_with_full_side_bonds_reaches_the_lowrank_optimum(layer):
    """A TT whose bonds other than the middle one are full is a rank-r factorisation at the
    middle bond: its calibrated start (the split-whitened TT-SVD) reaches SVD-LLM's optimum."""
    weight, gram = layer
    gram = damped(gram, 1e-10)
    tt, low = get_format("tt"), get_format("lowrank")
    rank = 5
    layout = tt.layout(*MODES["tt"], [2, 6, rank, 15, 5])
    cores = tt.decompose(weight, layout, gram)
    optimum = low.decompose(weight, low.layout((IN,), (OUT,), rank), gram)
    ours = output_error(weight, _dense(tt, cores, layout), gram)
    best = output_error(weight, optimum[0] @ optimum[1], gram)
    assert ours == pytest.approx(best, rel=1e-7)
