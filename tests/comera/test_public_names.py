"""comera's face: deprecated aliases are outside ``__all__`` and warn when used, naming their
replacement and the release they go in; everything in ``__all__`` imports without a warning."""

from __future__ import annotations

import warnings

import pytest

import comera

ALIASES = {"GatedTrain": "GatedLayer", "tt_modules": "gated_layers",
           "update_sizes": "relative_updates", "UpdateSizes": "RelativeUpdates",
           "UpdateSizeLog": "RelativeUpdateLog"}


@pytest.mark.parametrize(("old", "new"), sorted(ALIASES.items()))
def test_a_deprecated_alias_warns_naming_its_replacement(old, new):
    assert old not in comera.__all__ and new in comera.__all__
    with pytest.warns(DeprecationWarning, match=rf"comera\.{old} is deprecated: use "
                                                rf"comera\.{new}; the old name goes in 0\.3\.0"):
        assert getattr(comera, old) is getattr(comera, new)


def test_from_import_of_an_alias_warns_too():
    with pytest.warns(DeprecationWarning, match="comera.GatedTrain is deprecated"):
        from comera import GatedTrain
    assert GatedTrain is comera.GatedLayer


def test_star_import_and_every_public_name_are_quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        namespace: dict = {}
        exec("from comera import *", namespace)
        assert all(getattr(comera, name) is not None for name in comera.__all__)
    assert not set(ALIASES) & set(namespace)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'comera' has no attribute 'GatedTrian'"):
        comera.GatedTrian  # noqa: B018
