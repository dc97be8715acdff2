"""Every bad input to comera is a named error with a helpful message."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import comera
from comera import (
    ConfigError,
    ConvertConfig,
    FactorizationError,
    LateStage,
    TTEmbedding,
    TTLinear,
    TTMLinear,
)
from comera.ranks.objective import rank_regularizer, soft_size

LAYERS = (TTLinear, TTMLinear)


@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize("ranks", [[2, 2, 2, 2], [2], [1, 2, 2, 2, 2, 1]])
def test_ranks_of_the_wrong_length(cls, ranks):
    # TTLinear (3, 5) x (7, 2): 4 cores -> 3 interior / 5 full; TTMLinear: 2 cores -> 1 / 3
    if cls is TTMLinear and ranks == [2]:
        ranks = [2, 2]
    with pytest.raises(ConfigError, match=re.escape(f"has length {len(ranks)}")) as info:
        cls(15, 14, (3, 5), (7, 2), ranks=ranks)
    assert "interior" in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize("ranks", [0, -3, [2, 0, 2], [1, 2, -1, 2, 1]])
def test_rank_below_one(cls, ranks):
    if cls is TTMLinear and isinstance(ranks, list):
        ranks = [0] if len(ranks) == 3 else [1, 0, 1]
    with pytest.raises(ConfigError, match="rank"):
        cls(15, 14, (3, 5), (7, 2), ranks=ranks)


@pytest.mark.parametrize("cls", LAYERS)
def test_full_ranks_must_end_with_one(cls):
    ranks = [2, 2, 2, 2, 2] if cls is TTLinear else [2, 2, 2]
    with pytest.raises(ConfigError, match="start and end with 1"):
        cls(15, 14, (3, 5), (7, 2), ranks=ranks)


@pytest.mark.parametrize("cls", LAYERS)
def test_modes_whose_product_mismatches(cls):
    with pytest.raises(ConfigError, match=r"in_modes \(3, 4\) multiply to 12, not 15"):
        cls(15, 14, (3, 4), (7, 2))
    with pytest.raises(ConfigError, match=r"out_modes \(7, 3\) multiply to 21, not 14"):
        cls(15, 14, (3, 5), (7, 3))


@pytest.mark.parametrize("cls", LAYERS)
def test_in_and_out_modes_of_different_length(cls):
    with pytest.raises(ConfigError, match="differ in length"):
        cls(16, 16, (4, 4), (2, 2, 4))


@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize("tau", [-0.1, float("nan"), 1.0, 1e300, True])
def test_bad_tau(cls, tau):
    with pytest.raises(ConfigError, match=r"tau=.*in \[0, 1\)"):
        cls(15, 14, (3, 5), (7, 2), tau=tau)


def test_bad_tau_embedding():
    with pytest.raises(ConfigError, match="tau"):
        TTEmbedding(29, 12, (2, 3, 5), (2, 3, 2), tau=-1.0)


@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize("features", [0, -1, 2.5, True])
def test_bad_feature_sizes(cls, features):
    with pytest.raises(ConfigError, match="feature size"):
        cls(features, 4)


def test_prime_size_is_a_factorization_error():
    with pytest.raises(FactorizationError, match="suggest_padded_size"):
        TTLinear(769, 768)
    assert issubclass(FactorizationError, ConfigError)


def test_embedding_errors():
    with pytest.raises(ConfigError, match="fewer than num_embeddings=29"):
        TTEmbedding(29, 12, (2, 3, 4), (2, 3, 2))
    with pytest.raises(ConfigError, match="not embedding_dim=12"):
        TTEmbedding(29, 12, (2, 3, 5), (2, 3, 3))
    with pytest.raises(ConfigError, match="differ in length"):
        TTEmbedding(29, 12, (2, 3, 5), (4, 3))
    with pytest.raises(ConfigError, match=r"padding_idx=29 is outside \[0, 29\)"):
        TTEmbedding(29, 12, (2, 3, 5), (2, 3, 2), padding_idx=29)
    with pytest.raises(ConfigError, match=re.escape("from_embedding takes an nn.Embedding")):
        TTEmbedding.from_embedding(nn.Linear(2, 2))


@pytest.mark.parametrize("cls", LAYERS)
def test_from_linear_wrong_type(cls):
    pattern = re.escape("from_linear takes an nn.Linear, got Embedding")
    with pytest.raises(ConfigError, match=pattern):
        cls.from_linear(nn.Embedding(4, 4))


@pytest.mark.parametrize("ratio", [1.0, 0.5, 0.0, -2.0])
def test_late_stage_ratio_must_exceed_one(ratio):
    model = nn.Sequential(TTLinear(15, 14, (3, 5), (7, 2), ranks=2))
    with pytest.raises(ConfigError, match=re.escape(f"target compression {ratio}; it must be > 1")):
        LateStage.from_ratio(model, ratio)


def test_late_stage_bad_targets():
    with pytest.raises(ConfigError, match="target_size=0"):
        LateStage(0)
    with pytest.raises(ConfigError, match="target_loss=-1"):
        LateStage(10, target_loss=-1)


@pytest.mark.parametrize("target", [1.0, 0.5])
def test_convert_config_target_compression_must_exceed_one(target):
    pattern = re.escape(f"target_compression={target}; it must be a finite number > 1")
    with pytest.raises(ConfigError, match=pattern):
        ConvertConfig(target_compression=target)


def test_convert_config_other_errors():
    with pytest.raises(ConfigError, match="format='nope'; choose one of tt, ttm"):
        ConvertConfig(format="nope")
    with pytest.raises(ConfigError, match="format='einsum' is a declared network"):
        ConvertConfig(format={"*": "einsum"})
    with pytest.raises(ConfigError, match="ranks=0; a max rank is an int >= 1"):
        ConvertConfig(ranks=0)
    with pytest.raises(ConfigError, match="d=0"):
        ConvertConfig(d=0)
    with pytest.raises(ConfigError, match="nothing would be converted"):
        ConvertConfig(linear=False, embedding=False)


def test_unknown_regularizer():
    model = nn.Sequential(TTLinear(15, 14, (3, 5), (7, 2), ranks=2))
    with pytest.raises(ConfigError, match="regularizer 'l2'; choose one of l1, size_weighted"):
        rank_regularizer(model, "l2")
    with pytest.raises(ConfigError, match="regularizer 'l2'"):  # caught at construction
        comera.CoMERATrainer(model, regularizer="l2")


def test_trainer_without_tt_layers():
    model = nn.Sequential(nn.Linear(4, 4))
    pattern = re.escape("no TT layers: convert it with comera.convert_")
    with pytest.raises(ConfigError, match=pattern):
        comera.CoMERATrainer(model)
    with pytest.raises(ConfigError, match="no TT layers"):
        rank_regularizer(model)
    with pytest.raises(ConfigError, match="no TT layers"):
        soft_size(model)


def test_trainer_bad_lam_and_late_stage():
    model = nn.Sequential(TTLinear(15, 14, (3, 5), (7, 2), ranks=2))
    with pytest.raises(ConfigError, match="lam=-1"):
        comera.CoMERATrainer(model, lam=-1)
    trainer = comera.CoMERATrainer(model)
    with pytest.raises(ConfigError, match=re.escape("start_late_stage takes a comera.LateStage")):
        trainer.start_late_stage(3.0)


@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize("shape", [(4, 14), (2, 3, 16), (15, 1)])
def test_wrong_input_feature_size(cls, shape):
    layer = cls(15, 14, (3, 5), (7, 2), ranks=2)
    with pytest.raises(ConfigError) as info:
        layer(torch.randn(*shape))
    message = str(info.value)
    assert f"expects inputs whose last axis has 15 features, got shape {shape}" in message
    assert cls.__name__ in message


def test_error_hierarchy():
    assert issubclass(comera.LookupIndexError, IndexError)
    assert issubclass(comera.ConversionError, ValueError)
    assert issubclass(comera.CheckpointError, RuntimeError)
    for cls in (ConfigError, FactorizationError, comera.ConversionError,
                comera.CheckpointError, comera.LookupIndexError):
        assert issubclass(cls, comera.ComeraError)
