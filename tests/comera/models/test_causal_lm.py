"""CausalLM: shapes, the kinds of block linear layers, tied logits, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from comera import ConfigError, GatedLinear, TTLinear
from comera.models.causal_lm import CausalLM, CausalLMConfig

SMALL = CausalLMConfig(vocab_size=50, d_model=16, n_heads=2, d_ff=32, n_layers=2, max_len=12,
                       rank=3)


@pytest.mark.parametrize(("linear", "cls"), [("dense", nn.Linear), ("tt", TTLinear),
                                              ("lowrank", GatedLinear), ("tucker", GatedLinear),
                                              ("btt", GatedLinear)])
def test_every_block_linear_is_of_the_kind(linear, cls):
    torch.manual_seed(0)
    model = CausalLM(CausalLMConfig(**{**SMALL.__dict__, "linear": linear}))
    layers = model.block_linears()
    assert len(layers) == 12 and all(type(m) is cls for _, m in layers)
    assert all(m.bias is None for _, m in layers)
    if linear != "dense":
        assert all(m.format.name == linear and max(m.bond_sizes) <= 3 for _, m in layers)
    ids = torch.randint(0, 50, (3, 12))
    assert model(ids).shape == (3, 12, 50)


def test_logits_are_tied_to_the_token_table():
    torch.manual_seed(1)
    model = CausalLM(SMALL)
    ids = torch.randint(0, 50, (2, 5))
    with torch.no_grad():
        model.tokens.weight[7].zero_()
    assert torch.all(model(ids)[..., 7] == 0)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("linear", "einsum", "linear='einsum'; choose one of dense, tt"), ("n_heads", 3, "divisible"),
    ("rank", 0, "rank=0"), ("dropout", 1.0, "dropout")])
def test_bad_config(field, value, match):
    with pytest.raises(ConfigError, match=match):
        CausalLMConfig(**{**SMALL.__dict__, field: value})


def test_bad_ids():
    model = CausalLM(SMALL)
    with pytest.raises(ConfigError, match="max_len=12"):
        model(torch.zeros(1, 13, dtype=torch.long))
    with pytest.raises(ConfigError, match="expected"):
        model(torch.zeros(13, dtype=torch.long))
