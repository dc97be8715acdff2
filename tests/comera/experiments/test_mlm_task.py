"""The MLM task's config holds its TransformerConfig: the models it builds are bit-identical to
those of the flat MLMTaskConfig of before (its other tests: tests/comera/models/test_mlm.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from comera.experiments.mlm_task import MLMTask, MLMTaskConfig
from comera.formats.scaling import FRESH
from comera.models.mlm import MaskedLM
from comera.models.transformer import TransformerConfig, linear_layer
from tests.helpers.parameters import assert_same_parameters
from tests.helpers.tiny_corpus import write_tiny_corpus

TINY = MLMTaskConfig(seq_len=16, vocab_size=64, d_model=32, n_heads=2, d_ff=64, n_layers=1,
                     rank=4, embedding_rank=8, eval_limit=8)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_stdlib")
    write_tiny_corpus(root)
    return MLMTask(TINY, root=root, use_cache=False)


def flat_config(vocab: int, format: str, d_model: int = 32, d_ff: int = 64) -> TransformerConfig:
    """MLMTaskConfig.model_config of before, spelled out with TINY's values and the defaults of
    the flat class (dropout 0.1, a TT token table, rank-adaptive scaling)."""
    return TransformerConfig(
        vocab_size=vocab, d_model=d_model, n_heads=2, d_ff=d_ff, n_layers=1, max_len=16,
        dropout=0.1, linear_format=format, tt_embedding=True, rank=4, embedding_rank=8,
        attn_modes=None, ffn_in_modes=None, ffn_out_modes=None, embedding_modes=None,
        parametrization=FRESH)


def flat_build(vocab: int, format: str, rank: int, **sizes: int) -> nn.Module:
    """MLMTask.build of before: the dense MLM, then its block linear layers in ``format``."""
    model = MaskedLM(flat_config(vocab, "dense", **sizes))
    if format == "dense":
        return model
    for name, layer in MLMTask.block_linears(model):
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, linear_layer(
            format, layer.in_features, layer.out_features, rank, tau=model.cfg.tau,
            parametrization=model.cfg.parametrization))
    return model


def test_the_model_config_is_the_flat_one_of_before(task):
    for format in ("dense", "tt", "tucker"):
        assert TINY.model_config(task.vocab, format) == flat_config(task.vocab, format)
    full = MLMTaskConfig.full()
    assert full.model_config(100, "tt") == TransformerConfig(
        vocab_size=100, d_model=768, n_heads=12, d_ff=3072, n_layers=6, max_len=128,
        dropout=0.1, linear_format="tt", tt_embedding=True, rank=30, embedding_rank=32,
        attn_modes=None, ffn_in_modes=None, ffn_out_modes=None, embedding_modes=None,
        parametrization=FRESH)


@pytest.mark.filterwarnings("ignore:.*reaches the full rank")
@pytest.mark.parametrize("format", ["dense", "tt", "lowrank", "tucker"])
def test_models_are_bit_identical_to_those_of_the_flat_config(task, format):
    v = task.vocab
    for build, old in ((lambda: task.build_model(format), lambda: MaskedLM(flat_config(v, format))),
                       (lambda: task.build(format), lambda: flat_build(v, format, 4)),
                       (lambda: task.build(format, 3, d_model=8, d_ff=16),
                        lambda: flat_build(v, format, 3, d_model=8, d_ff=16))):
        torch.manual_seed(0)
        new = build()
        torch.manual_seed(0)
        assert_same_parameters(new, old())
