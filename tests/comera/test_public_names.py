"""comera's face: deprecated aliases are outside ``__all__`` and warn when used, naming their
replacement and the release they go in; everything in ``__all__`` imports without a warning."""

from __future__ import annotations

import warnings

import pytest

import comera

ALIASES = {"GatedTrain": "GatedLayer", "tt_modules": "gated_layers",
           "update_sizes": "relative_updates", "UpdateSizeLog": "RelativeUpdateLog"}


@pytest.mark.parametrize(("old", "new"), sorted(ALIASES.items()))
def test_a_deprecated_alias_warns_naming_its_replacement(old, new):
    assert old not in comera.__all__ and new in comera.__all__
    with pytest.warns(DeprecationWarning, match=rf"comera\.{old} is deprecated: use "
                                                rf"comera\.{new}; the old name goes in 0\.3\.0"):
        assert getattr(comera, old) is getattr(comera, new)


MOVED = {"TruncationReport": "comera.ranks.truncate",
         "clear_moments_": "comera.training.controller",
         "factorize_pair": "comera.formats.factorize",
         "rank_regularizer": "comera.ranks.objective",
         "suggest_padded_size": "comera.formats.factorize",
         # the 0.2.0 trim: names no documentation page calls from comera
         "RelativeUpdates": "comera.training.relative_updates", "dense_size": "comera.ranks.size",
         "factorize": "comera.formats.factorize", "param_groups": "comera.training.trainers",
         "register_format": "comera.formats.registry", "Format": "comera.formats.registry",
         "soft_size": "comera.ranks.objective",
         "CachedTTEmbedding": "comera.layers.cached_embedding",
         "EarlyStage": "comera.training.early", "Siblings": "comera.layers.siblings",
         "scaled_dot_product_attention": "comera.lean.sdpa",
         "BoolMaskDropout": "comera.lean.dropout", "ConversionReport": "comera.surgery.convert"}


def test_the_alias_of_a_name_that_left_the_face_names_its_submodule():
    from comera.training.relative_updates import RelativeUpdates

    with pytest.warns(DeprecationWarning, match=r"comera\.UpdateSizes is deprecated: use "
                      r"comera\.training\.relative_updates\.RelativeUpdates"):
        assert comera.UpdateSizes is RelativeUpdates


@pytest.mark.parametrize(("name", "home"), sorted(MOVED.items()))
def test_a_name_that_left_the_face_warns_naming_its_submodule(name, home):
    import importlib

    assert name not in comera.__all__
    with pytest.warns(DeprecationWarning, match=rf"comera\.{name} is deprecated: use "
                                                rf"{home}\.{name}; the old name goes in 0\.3\.0"):
        assert getattr(comera, name) is getattr(importlib.import_module(home), name)


def test_the_face_holds_no_more_than_the_documentation_calls_and_the_errors():
    """Every name of ``comera.__all__`` is called as ``comera.<name>`` (or imported from
    comera) in the README or docs/, or is one of comera's exceptions, or is on the list
    that still waits for the trim (a name added to the face without a documented call fails)."""
    import re

    import comera.errors
    from tests.helpers import ROOT

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    text = "\n".join(p.read_text() for p in pages if p.name != "api.md")
    called = {n for n in comera.__all__
              if re.search(rf"(comera\.{n}\b|from comera import[^\n]*\b{n}\b)", text)}
    errors = {n for n in comera.__all__ if n in vars(comera.errors)}
    rest = set(comera.__all__) - called - errors
    assert rest <= PENDING, f"in comera.__all__ but called by no page of the docs: {rest - PENDING}"


# still in comera.__all__, called by no documentation page (named in prose, or used across the
# repository from comera): the next trim's candidates
PENDING = {"GatedEmbedding", "RelativeUpdateLog", "TTMLinear", "relative_updates"}


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


@pytest.mark.parametrize(("home", "old", "new"), [
    ("comera.layers.linear", "GatedTrain", "GatedLayer"),
    ("comera.ranks.size", "tt_modules", "gated_layers"),
    ("comera.experiments.pair_task", "PairTask", "CodePairTask"),
    ("comera.experiments.pair_task", "PairTaskConfig", "CodePairTaskConfig")])
def test_an_alias_warns_from_its_home_module_too(home, old, new):
    import importlib

    module = importlib.import_module(home)
    assert old not in getattr(module, "__all__", ()) and old not in vars(module)
    with pytest.warns(DeprecationWarning, match=rf"{home}\.{old} is deprecated: use "
                                                rf"{home}\.{new}"):
        assert getattr(module, old) is getattr(module, new)
