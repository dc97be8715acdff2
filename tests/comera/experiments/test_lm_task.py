"""The causal LM task: its loader on a tiny corpus the test writes, targets, scores, engine."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

import comera
from comera import ConfigError
from comera.data.stdlib_corpus import IGNORE_INDEX
from comera.data.stdlib_pairs import split_of
from comera.data.tokenizer import CLS, PAD, SEP, UNK
from comera.experiments.engine import EngineConfig
from comera.experiments.lm_task import LMTask, LMTaskConfig, next_token_targets
from comera.experiments.registry import EXPERIMENTS, experiment
from comera.experiments.results import run_experiment
from comera.formats.scaling import FRESH
from comera.models.causal_lm import CausalLM, CausalLMConfig
from tests.helpers.parameters import assert_same_parameters
from tests.helpers.tiny_corpus import write_tiny_corpus

TINY = LMTaskConfig(seq_len=16, vocab_size=64, d_model=16, n_heads=2, d_ff=32, n_layers=1,
                    rank=4, eval_limit=None, eval_batch_size=5)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_stdlib")
    return root, write_tiny_corpus(root)


@pytest.fixture(scope="module")
def task(corpus):
    return LMTask(TINY, root=corpus[0], use_cache=False)


def test_loader_splits_by_module(task, corpus):
    _, chosen = corpus
    got = {"train": task.train.modules, "val": task.splits["val"].modules,
           "test": task.splits["test"].modules}
    for split, modules in got.items():
        assert sorted(modules) == sorted(chosen[split])
        assert all(split_of(m) == split for m in modules)
    assert not set(got["train"]) & set(got["val"]) | set(got["train"]) & set(got["test"])
    for data in (task.train, *task.splits.values()):
        assert len(data) > 0 and data.ids.shape[1] == TINY.seq_len
        assert (data.ids[:, 0] == CLS).all()
    assert task.vocab <= TINY.vocab_size


def test_next_token_targets():
    ids = torch.tensor([[CLS, 7, UNK, 9, SEP, PAD]])
    inputs, targets = next_token_targets(ids)
    assert inputs.tolist() == [[CLS, 7, UNK, 9, SEP]]
    assert targets.tolist() == [[7, UNK, 9, IGNORE_INDEX, IGNORE_INDEX]]
    with pytest.raises(ConfigError, match="seq_len >= 2"):
        next_token_targets(torch.tensor([[CLS]]))


def test_loss_is_next_token_cross_entropy(task):
    torch.manual_seed(0)
    model = task.build_model("dense")
    batch = task.batch(torch.arange(4))
    logits = model(batch[:, :-1])
    keep = next_token_targets(batch)[1] != IGNORE_INDEX
    want = nn.functional.cross_entropy(logits[keep], batch[:, 1:][keep])
    torch.testing.assert_close(task.loss(model, batch), want)


def test_model_is_causal(task):
    torch.manual_seed(1)
    model = task.build_model("dense").eval()
    ids = task.batch(torch.arange(2))
    changed = ids.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % task.vocab
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9])
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_evaluate_scores_every_predicted_token(task):
    torch.manual_seed(2)
    model = task.build_model("dense").eval()
    scores = task.evaluate(model, "val")
    rows = task.splits["val"].ids
    inputs, targets = next_token_targets(rows)
    keep = targets != IGNORE_INDEX
    with torch.no_grad():
        loss = float(nn.functional.cross_entropy(model(inputs)[keep], targets[keep]))
    assert scores["tokens"] == keep.sum().item()
    assert scores["loss"] == pytest.approx(loss, rel=1e-5)
    assert scores["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)
    assert 0.0 <= scores["accuracy"] <= 1.0
    with pytest.raises(ConfigError, match="split 'train'"):
        task.evaluate(model, "train")


def test_models_of_each_kind(task):
    tt = task.build("tt", 3)
    assert [n for n, _ in comera.gated_layers(tt)] == [n for n, _ in tt.block_linears()]
    assert all(max(m.ranks) <= 3 for _, m in comera.gated_layers(tt))
    low = task.build("lowrank", 2)
    assert all(m.format.name == "lowrank" and m.ranks == (2,) for _, m in low.block_linears())
    dense = task.build_model("dense")
    assert not any(True for _ in comera.gated_layers(dense))
    assert all(m.bias is None for _, m in dense.block_linears())


@pytest.mark.filterwarnings("ignore:.*reaches the full rank")
@pytest.mark.parametrize("format", ["dense", "tt", "lowrank", "tucker"])
def test_models_are_bit_identical_to_those_of_the_flat_config(task, format):
    """The task config holds its model config; the models it builds are, parameter for
    parameter, those of the flat LMTaskConfig of before (its model_config spelled out)."""
    def flat(rank: int, d_model: int = 16, d_ff: int = 32) -> CausalLM:
        return CausalLM(CausalLMConfig(
            vocab_size=task.vocab, d_model=d_model, n_heads=2, d_ff=d_ff, n_layers=1,
            max_len=16, dropout=0.0, linear=format, rank=rank, tt_order=3,
            parametrization=FRESH))

    for build, old in ((lambda: task.build_model(format), lambda: flat(4)),
                       (lambda: task.build(format, 3), lambda: flat(3)),
                       (lambda: task.build(format, 2, d_model=8, d_ff=16),
                        lambda: flat(2, d_model=8, d_ff=16))):
        torch.manual_seed(0)
        new = build()
        torch.manual_seed(0)
        assert_same_parameters(new, old())


def test_bad_inputs(task, tmp_path):
    with pytest.raises(ConfigError, match="training split has"):
        task.batch(torch.tensor([len(task.train)]))
    with pytest.raises(ConfigError, match="eval_limit"):
        LMTaskConfig(eval_limit=0)
    with pytest.raises(ConfigError, match="not a directory"):
        LMTask(TINY, root=tmp_path / "missing", use_cache=False)


@pytest.mark.slow
def test_experiment_trains_dense_and_comera(task, tmp_path):
    """What `comera train lm` runs (run_experiment), on the tiny corpus."""
    config = EngineConfig(steps_early=4, steps_late=3, batch_size=4, lr=1e-2, warmup=2,
                          lam=0.02, target_compression=2.0, eval_every=10, threads=1)
    summary = run_experiment(task, config, tmp_path)
    rows = {r["name"]: r for r in summary["rows"]}
    assert set(rows) == {"dense", "comera (early)", "comera (late)"}
    assert rows["dense"]["val"]["perplexity"] > 1 and summary["metric"] == "perplexity"
    assert rows["comera (late)"]["sizes"]["linear_compression"] > 1.5
    assert (tmp_path / "lm.json").is_file() and (tmp_path / "lm.md").is_file()


def test_registered_with_quick_and_full_settings():
    lm = experiment("lm")
    assert lm is EXPERIMENTS["lm"]
    assert lm.quick.target_compression == 8.0 and lm.quick.total_steps < lm.full.total_steps
    assert replace(LMTaskConfig.full(), quick=True).d_model > LMTaskConfig().d_model
