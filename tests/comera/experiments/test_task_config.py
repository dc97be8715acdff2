"""Task configs hold their model config: nested and flat construction, reads, ``replace``,
pickles of the flat classes of before, and the errors (comera.experiments.task_config)."""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from comera.errors import ConfigError
from comera.experiments.lm_task import LMTaskConfig
from comera.experiments.mlm_task import MLMTaskConfig
from comera.experiments.task_config import config_keywords, holds_model
from comera.models.causal_lm import CausalLMConfig
from comera.models.transformer import TransformerConfig

# pickled by the flat classes of commit fac7af5, with what each of their fields read
FLAT_PICKLES = Path(__file__).parent / "data" / "task_configs_flat.pkl"

# the sizes each task config took as fields before it held its model config
OLD_LM_SIZES = {"vocab_size", "d_model", "n_heads", "d_ff", "n_layers", "rank", "tt_order",
                "parametrization", "dropout"}
OLD_MLM_SIZES = {"vocab_size", "d_model", "n_heads", "d_ff", "n_layers", "rank",
                 "embedding_rank", "parametrization", "tt_embedding", "dropout"}


def test_each_size_is_a_field_of_the_model_config_only():
    for task, model, old in ((LMTaskConfig, CausalLMConfig, OLD_LM_SIZES),
                             (MLMTaskConfig, TransformerConfig, OLD_MLM_SIZES)):
        own = {f.name for f in dataclasses.fields(task)}
        assert "model" in own and not own & {f.name for f in dataclasses.fields(model)}
        assert old <= task.flat_keywords <= {f.name for f in dataclasses.fields(model)}
        assert config_keywords(task) == own | task.flat_keywords


def test_flat_and_nested_construction_give_one_config():
    flat = LMTaskConfig(d_model=256, n_heads=8, tt_order=4, seq_len=32)
    nested = LMTaskConfig(CausalLMConfig(d_model=256, n_heads=8, tt_order=4), seq_len=32)
    assert flat == nested and hash(flat) == hash(nested)
    assert flat.d_model == flat.model.d_model == 256 and flat.tt_order == 4
    assert flat.model.max_len == 32  # the model reads rows of seq_len
    mlm = MLMTaskConfig(d_model=64, embedding_rank=8, seq_len=16)
    assert mlm == MLMTaskConfig(model=replace(MLMTaskConfig().model, d_model=64,
                                              embedding_rank=8), seq_len=16)
    assert mlm.embedding_rank == 8 and mlm.model.attn_modes is None


def test_flat_keywords_override_the_given_model():
    config = LMTaskConfig(model=CausalLMConfig(d_model=64, d_ff=128), d_model=32)
    assert (config.d_model, config.d_ff) == (32, 128)


def test_replace_sets_sizes_in_the_model_and_max_len_follows_seq_len():
    config = LMTaskConfig.full()
    wider = replace(config, d_model=1024, seq_len=256)
    assert wider.model == replace(config.model, d_model=1024, max_len=256)
    assert (wider.eval_limit, wider.quick) == (config.eval_limit, config.quick)
    assert replace(config, model=CausalLMConfig()).model.max_len == config.seq_len
    assert replace(MLMTaskConfig.full(), quick=True).d_model == 768


def test_sizes_are_read_only():
    with pytest.raises(AttributeError):
        LMTaskConfig().d_model = 3  # type: ignore[misc]


def test_bad_inputs_name_the_value():
    with pytest.raises(ConfigError, match="d_model=0; it must be an int >= 1"):
        LMTaskConfig(d_model=0)  # the model config checks its own sizes, at once
    with pytest.raises(ConfigError, match=r"model=.*give a CausalLMConfig"):
        LMTaskConfig(model=TransformerConfig())
    with pytest.raises(ConfigError, match=r"model=\{'d_model': 3\}; give a TransformerConfig"):
        MLMTaskConfig(model={"d_model": 3}, d_model=4)
    with pytest.raises(TypeError, match="max_len"):  # seq_len sets it
        LMTaskConfig(max_len=32)
    with pytest.raises(TypeError, match="linear"):  # each build chooses the kind
        LMTaskConfig(linear="tt")
    for task in (LMTaskConfig, MLMTaskConfig):  # named as the task's, not the model's max_len
        with pytest.raises(ConfigError, match=r"^seq_len=2; a row holds"):
            task(seq_len=2)
    with pytest.raises(ConfigError, match="eval_batch_size=0"):
        MLMTaskConfig(eval_batch_size=0)
    with pytest.raises(ConfigError, match="eval_limit=True; give a number of sequences"):
        MLMTaskConfig(eval_limit=True)


def test_a_task_config_without_a_default_model_is_refused_at_definition():
    with pytest.raises(TypeError, match="needs a field `model`"):
        @holds_model()
        @dataclass(frozen=True)
        class NoModel:
            seq_len: int = 3
    with pytest.raises(TypeError, match=r"\['d_model'\] are also the model's"):
        @holds_model()
        @dataclass(frozen=True)
        class Both:
            model: CausalLMConfig = CausalLMConfig()  # noqa: RUF009
            d_model: int = 3


@pytest.mark.parametrize("name", ["lm_quick", "lm_full", "lm_tiny", "mlm_quick", "mlm_full",
                                  "mlm_tiny"])
def test_a_flat_pickle_of_before_loads_as_the_nested_config(name):
    saved = pickle.loads(FLAT_PICKLES.read_bytes())
    config, reads = saved["configs"][name], saved["reads"][name]
    kind = LMTaskConfig if name.startswith("lm") else MLMTaskConfig
    assert type(config) is kind and config == kind(**reads)
    assert {k: getattr(config, k) for k in reads} == reads
    assert config.model.max_len == config.seq_len
    assert pickle.loads(pickle.dumps(config)) == config


def test_a_flat_pickle_missing_a_later_size_takes_its_default():
    """A config pickled before ``parametrization`` and ``tt_order`` existed."""
    old = pickle.loads(FLAT_PICKLES.read_bytes())["reads"]["lm_tiny"]
    state = {k: v for k, v in old.items() if k not in ("parametrization", "tt_order")}
    config = LMTaskConfig.__new__(LMTaskConfig)
    config.__setstate__(state)
    assert config == LMTaskConfig(**state)
    assert (config.tt_order, config.parametrization) == (3, LMTaskConfig().parametrization)
