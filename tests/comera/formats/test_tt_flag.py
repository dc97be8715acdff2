"""The deprecated tt flag's one home (comera.formats.tt_flag), and its old import path."""

from __future__ import annotations

import pickle

import pytest

from comera.errors import ConfigError
from comera.formats import tt_flag
from comera.formats.tt_flag import FLAG_FORMAT, NO_FLAG, format_from_tt, restore_kind_
from comera.models import TransformerConfig


def test_the_old_import_path_gives_the_same_objects():
    from comera.models import transformer

    for name in ("NO_FLAG", "TT_FLAG_RELEASE", "format_from_tt", "restore_kind_"):  # those then
        assert getattr(transformer, name) is getattr(tt_flag, name)


def test_the_flag_reads_as_a_kind_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"give K\('tt'\)"):
        assert format_from_tt(True, "tt", "K({})") == "tt"
    with pytest.warns(DeprecationWarning, match=r"give K\('dense'\).*0\.3\.0"):
        assert format_from_tt(False, "tucker", "K({})") == "dense"


def test_a_flag_that_contradicts_the_kind_or_is_no_bool_is_refused():
    with pytest.raises(ConfigError, match="tt=True beside the kind 'dense'"):
        format_from_tt(True, "dense", "K({})")
    with pytest.raises(ConfigError, match="tt=1: the deprecated flag is True or False"):
        format_from_tt(1, "tt", "K({})")


def test_no_flag_refuses_to_be_tested():
    with pytest.raises(ConfigError, match="no tt flag"):
        bool(NO_FLAG)


def test_a_config_pickled_with_the_flag_loads_as_the_kind_it_built():
    cfg = TransformerConfig.small(100)
    state = dict(cfg.__dict__, tt=False)
    loaded = TransformerConfig.__new__(TransformerConfig)
    restore_kind_(loaded, state, "linear_format")
    assert loaded.linear_format == "dense" and "tt" not in loaded.__dict__
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # a config of today keeps its kind


def test_a_config_pickled_before_its_kind_had_a_field_loads_as_what_the_flag_built():
    """A TransformerConfig of before linear_format (tt=True, no kind stored) was TT, whatever the
    field's default is today (FLAG_FORMAT); a model config whose flag built another kind names
    it (flag_kind). A kind it stored is kept."""
    state = {k: v for k, v in TransformerConfig.small(100, linear_format="ttm").__dict__.items()
             if k != "linear_format"}

    def loaded(saved: dict, **kind) -> TransformerConfig:
        config = TransformerConfig.__new__(TransformerConfig)
        restore_kind_(config, saved, "linear_format", **kind)
        return config

    assert FLAG_FORMAT == "tt"
    old = loaded({**state, "tt": True})
    assert old.__dict__["linear_format"] == "tt" and "tt" not in old.__dict__
    assert loaded({**state, "tt": True}, flag_kind="ttm").linear_format == "ttm"
    assert loaded({**state, "tt": True, "linear_format": "tucker"}).linear_format == "tucker"
    assert "linear_format" not in loaded(state).__dict__  # no flag: nothing to restore
