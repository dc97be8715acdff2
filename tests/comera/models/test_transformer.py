"""TransformerConfig checks its sizes with the one check the model configs share (check_sizes)."""

from __future__ import annotations

import pytest

from comera.errors import ConfigError
from comera.models.causal_lm import CausalLMConfig
from comera.models.transformer import TransformerConfig


@pytest.mark.parametrize(("field", "value", "match"), [
    ("rank", 0, "rank=0; it must be an int >= 1"),
    ("d_ff", 512.0, "d_ff=512.0; it must be an int >= 1"),
    ("n_layers", True, "n_layers=True; it must be an int >= 1"),
    ("embedding_rank", None, "embedding_rank=None"),
    ("n_heads", 5, "d_model=768 is not divisible by n_heads=5"),
    ("dropout", 1.0, r"dropout=1.0; it lies in \[0, 1\)")])
def test_bad_sizes_are_refused_naming_the_value(field, value, match):
    with pytest.raises(ConfigError, match=match):
        TransformerConfig(**{field: value})


@pytest.mark.parametrize("config", [TransformerConfig, CausalLMConfig])
def test_both_model_configs_share_the_message(config):
    with pytest.raises(ConfigError, match=r"^d_model='x'; it must be an int >= 1\.$"):
        config(d_model="x")
