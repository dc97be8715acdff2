"""A model config names its layers' kind in one word: ``TransformerConfig.linear_format`` and
``DLRMConfig.table_format``, ``"dense"`` the baseline. The ``tt`` flag of before still builds,
warned until 0.3.0; configs pickled with it load as the model they built (issue 43)."""

from __future__ import annotations

import io
import pickle
import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn

import comera
from comera.models import DLRM, DLRMConfig, MaskedLM, PairClassifier, TransformerConfig

SMALL = dict(d_model=16, n_heads=2, d_ff=32, n_layers=1, max_len=8, rank=2, embedding_rank=2,
             dropout=0.0)
TINY_DLRM = dict(cardinalities=(60, 7, 200), embedding_dim=4, bottom_mlp=(8, 4),
                 top_mlp=(6, 1), tt_min_rows=100, tt_ranks=3)


def _kinds(model: nn.Module) -> set[type]:
    return {type(m) for m in model.modules() if isinstance(m, nn.Linear | nn.Embedding
                                                            | comera.GatedLayer)}


def test_linear_format_dense_is_the_dense_baseline():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        cfg = TransformerConfig.small(50, linear_format="dense", **SMALL)
        model = PairClassifier(cfg)
        mlm = MaskedLM(cfg)
        again = replace(cfg, rank=3)  # replace reads no flag: no warning
    assert _kinds(model) == _kinds(mlm) == {nn.Linear, nn.Embedding}
    assert again.linear_format == "dense"
    tt = PairClassifier(replace(cfg, linear_format="tt"))
    assert any(isinstance(m, comera.TTLinear) for m in tt.modules())
    with pytest.raises(comera.ConfigError, match="linear_format='nope'; choose one of dense"):
        TransformerConfig.small(50, linear_format="nope", **SMALL)
    with pytest.raises(comera.ConfigError, match="linear_format='einsum' is a declared network"):
        TransformerConfig.small(50, linear_format="einsum", **SMALL)


def test_transformer_config_tt_flag_warns_and_still_builds():
    with pytest.warns(DeprecationWarning, match=r"tt=False is deprecated.*"
                                                r"TransformerConfig\(linear_format='dense'\).*"
                                                r"goes in 0\.3\.0"):
        old = TransformerConfig(tt=False, **SMALL)
    assert old == TransformerConfig(linear_format="dense", **SMALL)
    with pytest.warns(DeprecationWarning, match="linear_format='tucker'"):
        assert TransformerConfig(tt=True, linear_format="tucker").linear_format == "tucker"
    with pytest.warns(DeprecationWarning):  # replace(cfg, tt=...) of before, too
        assert replace(TransformerConfig(**SMALL), tt=False).linear_format == "dense"
    with pytest.raises(comera.ConfigError, match=r"tt=True beside the kind 'dense' "
                                                 r"\(TransformerConfig\(linear_format='dense'\)"):
        TransformerConfig(tt=True, linear_format="dense")
    with pytest.raises(comera.ConfigError, match=r"tt='yes'"):
        TransformerConfig(tt="yes")


def test_reading_the_removed_flag_fails_loudly():
    cfg = TransformerConfig(**SMALL)
    with pytest.raises(comera.ConfigError, match=r"linear_format != \"dense\""):
        bool(cfg.tt)
    with pytest.raises(comera.ConfigError, match="table_format"):
        bool(DLRMConfig().tt)


def test_dlrm_table_format_dense_is_the_default_and_the_baseline():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert DLRMConfig().table_format == "dense"
        dense = DLRM(DLRMConfig(**TINY_DLRM))
        assert DLRMConfig(**TINY_DLRM, table_format="tt").table_format == "ttm"  # TT's tables
        assert replace(DLRMConfig(**TINY_DLRM), tt_ranks=2).table_format == "dense"
    assert all(isinstance(t, nn.Embedding) for t in dense.embeddings)
    with pytest.raises(comera.ConfigError, match="table_format='einsum' holds no embedding"):
        DLRMConfig(table_format="einsum")


def test_dlrm_config_tt_flag_warns_and_still_builds():
    with pytest.warns(DeprecationWarning, match=r"DLRMConfig\(table_format='ttm'\)"):
        cfg = DLRMConfig(**TINY_DLRM, tt=True)  # the tables of before: TT-matrix
    assert cfg.table_format == "ttm" and cfg.is_tt_table(2) and not cfg.is_tt_table(0)
    with pytest.warns(DeprecationWarning, match=r"DLRMConfig\(table_format='dense'\)"):
        assert DLRMConfig(tt=False, table_format="ttm").table_format == "dense"
    with pytest.raises(comera.ConfigError, match=r"tt=True beside the kind 'dense' "
                                                 r"\(DLRMConfig\(table_format='dense'\)"):
        DLRMConfig(tt=True, table_format="dense")


def _new(cls: type):
    return cls.__new__(cls)


class _PickledBefore:
    """Pickles as an instance of ``cls`` with the state ``state``: what a config object of the
    code before wrote into a pickle (its ``__dict__``, the ``tt`` flag in it)."""

    def __init__(self, cls: type, state: dict):
        self.cls, self.state = cls, state

    def __reduce__(self):
        return _new, (self.cls,), self.state


def test_a_model_pickled_with_the_tt_flag_in_its_config_loads_as_it_was_built():
    cfg = TransformerConfig.small(50, linear_format="dense", **SMALL)
    model = PairClassifier(cfg)
    # the dense model of before: tt=False beside linear_format="tt" in the saved config
    model.cfg = _PickledBefore(TransformerConfig, {**vars(cfg), "tt": False,
                                                   "linear_format": "tt"})
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded.cfg, TransformerConfig) and loaded.cfg == cfg
    assert _kinds(PairClassifier(loaded.cfg)) == {nn.Linear, nn.Embedding}  # rebuilt alike
    compressed = {**vars(cfg), "tt": True, "linear_format": "tucker"}
    assert pickle.loads(pickle.dumps(_PickledBefore(TransformerConfig, compressed))) == \
        replace(cfg, linear_format="tucker")
    dlrm = DLRMConfig(**TINY_DLRM)
    for flag, kind in ((False, "dense"), (True, "ttm")):
        state = {**vars(dlrm), "tt": flag, "table_format": "ttm"}
        assert pickle.loads(pickle.dumps(_PickledBefore(DLRMConfig, state))) == \
            replace(dlrm, table_format=kind)


def test_a_dlrm_config_pickled_before_table_format_loads_with_tt_matrix_tables():
    """DLRMConfig had a tt flag and no table_format (before 0.2.0): tt=True built TT-matrix
    tables, whatever the field's default is today ("dense")."""
    dlrm = DLRMConfig(**TINY_DLRM, table_format="ttm")
    state = {k: v for k, v in vars(dlrm).items() if k != "table_format"}
    for flag, kind in ((True, "ttm"), (False, "dense")):
        loaded = pickle.loads(pickle.dumps(_PickledBefore(DLRMConfig, {**state, "tt": flag})))
        assert loaded == replace(dlrm, table_format=kind)
