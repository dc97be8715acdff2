"""The Format base class owns calibration (comera/formats/registry.py): a format supplies its
plain decomposition (and, optionally, spectra and starts); capabilities are read from the hooks
it defines, one way; no built-in format handles a gram itself."""

from __future__ import annotations

import math

import pytest
import torch

from comera.formats.layout import Layout
from comera.formats.registry import Format, format_names, get_format
from comera.formats.whitened import damped, output_error

F64 = torch.float64


class Svd(Format):
    """A user's format that defines only its layout and its plain decomposition."""

    name, title, uses_modes = "svd_user", "user SVD", False
    plain_calls = 0

    def layout(self, in_modes, out_modes, ranks) -> Layout:
        (n_in,), (n_out,) = in_modes, out_modes
        return Layout(("i",), ("o",), (("i", "r"), ("r", "o")),
                      (("i", n_in), ("o", n_out), ("r", ranks)), ("r",))

    def plain_decomposition(self, weight, layout):
        type(self).plain_calls += 1
        u, s, vh = torch.linalg.svd(weight.to(F64), full_matrices=False)
        r = layout.size("r")
        return [u[:, :r] * s[:r], vh[:r]]


class Bare(Format):
    name, title = "bare", "bare"

    def layout(self, in_modes, out_modes, ranks) -> Layout:
        return Layout(("i",), ("o",), (("i", "r"), ("r", "o")),
                      (("i", 4), ("o", 5), ("r", 2)), ("r",))


def test_capabilities_follow_the_hooks():
    svd, bare = Svd(), Bare()
    assert svd.has_decomposition and svd.calibrates and not svd.has_spectra
    assert not (bare.has_decomposition or bare.calibrates or bare.has_spectra)
    layout = bare.layout((4,), (5,), 2)
    assert bare.decompose(torch.randn(4, 5), layout) is None
    assert bare.decompose(torch.randn(4, 5), layout, torch.eye(4)) is None
    assert bare.spectra(torch.randn(4, 5), layout) is None


def test_a_format_with_only_a_plain_decomposition_calibrates():
    gen = torch.Generator().manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(12, 12, generator=gen, dtype=F64))
    x = (torch.randn(500, 12, generator=gen, dtype=F64) * torch.logspace(0, -3, 12,
                                                                         dtype=F64)) @ basis.T
    weight = torch.randn(12, 9, generator=gen, dtype=F64) / math.sqrt(12)
    gram = x.T @ x / x.shape[0]
    fmt = Svd()
    layout = fmt.layout((12,), (9,), 3)
    before = Svd.plain_calls
    plain = layout.dense(fmt.decompose(weight, layout))
    assert Svd.plain_calls == before + 1
    calibrated = layout.dense(fmt.decompose(weight, layout, damped(gram, 1e-8)))
    assert Svd.plain_calls > before + 1  # the whitened path runs the same hook
    assert output_error(weight, calibrated, gram) < 0.9 * output_error(weight, plain, gram)


@pytest.mark.parametrize("name", format_names())
def test_no_builtin_format_handles_a_gram_itself(name):
    cls = type(get_format(name))
    for method in ("decompose", "spectra"):
        assert getattr(cls, method) is getattr(Format, method), (name, method)
    fmt = get_format(name)
    assert fmt.calibrates == fmt.has_decomposition


def test_calibrates_is_a_read_only_property():
    with pytest.raises(AttributeError):
        get_format("tt").calibrates = False  # type: ignore[misc]
