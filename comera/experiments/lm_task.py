"""Causal language modelling (GPT-style) on the CPython standard-library sources.

    task = LMTask(LMTaskConfig())             # quick: d_model 128, 2 blocks, 64 tokens
    model = task.build_model()                # every block linear layer TT-matrix ("ttm")
    ids = task.batch(indices)                 # (b, seq_len) token rows
    loss = task.loss(model, ids)              # next-token cross-entropy

Data: the sequences of :func:`~comera.data.stdlib_corpus.load_stdlib_corpus` (split by module
with its hash rule, so no file lands in two splits; the word-level vocabulary is built on the
training split). Each row is ``[CLS] tokens [SEP] [PAD]...`` from one file; the model reads
positions ``0 .. s-2`` and predicts positions ``1 .. s-1``. Only word tokens (and ``[UNK]``) are
predicted: ``[SEP]`` closes every full row at a fixed position, so predicting it would score
the position, not the text.

The metric is validation perplexity, exp(mean next-token cross-entropy) over a fixed spread-out
subset of ``eval_limit`` validation rows (lower is better); ``evaluate`` also reports the loss
and next-token accuracy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from comera import ConfigError
from comera.data.stdlib_corpus import (
    FIRST_WORD,
    IGNORE_INDEX,
    load_corpus_splits,
)
from comera.data.tokenizer import UNK
from comera.experiments.task import Task, model_format, spread_subset
from comera.experiments.task_config import check_corpus_settings, holds_model
from comera.layers.linear import FRESH_FORMAT
from comera.models.causal_lm import CausalLM, CausalLMConfig

EVAL_SPLITS = ("val", "test")
#: the quick run's model (CausalLMConfig's defaults; each build sets its vocabulary and kind)
QUICK_MODEL = CausalLMConfig()


@holds_model(follows={"max_len": "seq_len"}, not_flat=("linear",))
@dataclass(frozen=True)
class LMTaskConfig:
    """The model's config (:class:`CausalLMConfig`) and the data and scoring settings around it.
    The defaults are the quick run (a few CPU-minutes per model); :meth:`full` a wider, deeper
    model on longer rows.

    The model's sizes are its config's fields, read and set here by name too
    (``LMTaskConfig(d_model=256).d_model``; :mod:`comera.experiments.task_config`). Its
    ``max_len`` is ``seq_len`` and the layer kind is each build's (``build(format)``), so
    ``model.linear`` is not read; ``model.vocab_size`` is the vocabulary asked of the
    tokenizer, the built model takes the size it got."""

    model: CausalLMConfig = QUICK_MODEL
    quick: bool = True
    seq_len: int = 64
    eval_limit: int | None = 512  # rows of val/test scored (a fixed spread-out subset)
    eval_batch_size: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        check_corpus_settings(self.seq_len, self.eval_limit, self.eval_batch_size, "rows")

    @classmethod
    def full(cls) -> LMTaskConfig:
        """d_model 512, 8 heads, FFN 2048, 6 blocks, 128 tokens, vocabulary 16384."""
        model = CausalLMConfig(vocab_size=16384, d_model=512, n_heads=8, d_ff=2048, n_layers=6,
                               rank=32)
        return cls(model, quick=False, seq_len=128, eval_limit=None)

    def model_config(self, vocab_size: int, format: str = "dense",
                     rank: int | None = None) -> CausalLMConfig:
        """The model's config with ``vocab_size`` tokens and block linear layers of the kind
        ``format`` ("dense" or a registered format) at ``rank`` (default: the max rank
        ``self.rank``)."""
        return replace(self.model, vocab_size=vocab_size, linear=format,
                       rank=self.model.rank if rank is None else rank)


def next_token_targets(ids: Tensor) -> tuple[Tensor, Tensor]:
    """(inputs (b, s-1), targets (b, s-1)) of rows ``ids`` (b, s): targets are the next ids,
    ``-100`` where the next id is a special token other than ``[UNK]``."""
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ConfigError(f"ids has shape {tuple(ids.shape)}; expected (batch, seq_len >= 2).")
    nxt = ids[:, 1:]
    predicted = (nxt >= FIRST_WORD) | (nxt == UNK)
    return ids[:, :-1], torch.where(predicted, nxt, IGNORE_INDEX)


class LMTask(Task):
    """GPT-style causal LM on the stdlib corpus; metric: validation perplexity."""

    name = "lm"
    metric = "perplexity"
    higher_is_better = False
    # TT-matrix: at the quick run's 8x it ends at dense's perplexity, TT well above
    # (benchmarks/results/quick_defaults)
    recommended_format = FRESH_FORMAT

    def __init__(self, config: LMTaskConfig | None = None, root: Path | str | None = None,
                 use_cache: bool = True):
        self.config = config if config is not None else LMTaskConfig()
        c = self.config
        self.train, self.splits, self.tokenizer = load_corpus_splits(
            c.seq_len, c.vocab_size, root=root, use_cache=use_cache)
        self.vocab = len(self.tokenizer.vocab)

    # -- models -------------------------------------------------------------------------------
    def build(self, format: str = "dense", rank: int | None = None, **sizes: int) -> CausalLM:
        """The model with block linear layers of the kind ``format`` ("dense" or a registered
        format) at ``rank``, initialised from the current RNG; ``sizes``: other model sizes of
        the config (``d_model``, ``d_ff``, ...: a narrower model on the same data)."""
        config = replace(self.config, **sizes) if sizes else self.config
        return CausalLM(config.model_config(self.vocab, model_format(format), rank))

    def build_model(self, format: str = FRESH_FORMAT) -> nn.Module:
        """The model of the CoMERA run (block linear layers in ``format``, by default the
        task's :attr:`recommended_format`) or the dense one (``"dense"``)."""
        return self.build(format)

    @staticmethod
    def block_linears(model: CausalLM) -> list[tuple[str, nn.Module]]:
        """(name, layer) of every block linear layer: the layers a frontier compresses."""
        return model.block_linears()

    # -- Task protocol ------------------------------------------------------------------------
    def train_size(self) -> int:
        return len(self.train)

    def batch(self, indices: Tensor) -> Tensor:
        """The training rows at ``indices``: token ids (b, seq_len)."""
        indices = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= len(self.train)):
            raise ConfigError(f"example indices span [{int(indices.min())}, "
                              f"{int(indices.max())}]; the training split has "
                              f"{len(self.train)} examples.")
        return self.train.ids[indices]

    def loss(self, model: nn.Module, batch: Tensor) -> Tensor:
        inputs, targets = next_token_targets(batch)  # (b, s-1) each
        logits = model(inputs)  # (b, s-1, V)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                           ignore_index=IGNORE_INDEX)

    def eval_rows(self, split: str) -> Tensor:
        """The fixed rows that ``evaluate`` scores on ``split``."""
        if split not in self.splits:
            raise ConfigError(f"split {split!r}; choose one of {', '.join(EVAL_SPLITS)}.")
        data = self.splits[split]
        return data.ids[spread_subset(len(data), self.config.eval_limit, self.config.seed)]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        rows = self.eval_rows(split)
        device = next(model.parameters()).device
        total, correct, count = 0.0, 0, 0
        size = self.config.eval_batch_size
        for start in range(0, rows.shape[0], size):
            inputs, targets = next_token_targets(rows[start:start + size].to(device))
            keep = targets != IGNORE_INDEX  # (b, s-1)
            if not bool(keep.any()):
                continue
            logits = model(inputs)[keep]  # (n, V)
            goal = targets[keep]  # (n,)
            total += float(nn.functional.cross_entropy(logits.float(), goal, reduction="sum"))
            correct += int((logits.argmax(1) == goal).sum())
            count += goal.numel()
        if count == 0:
            raise ConfigError(f"the {split} rows hold no token to predict; use a larger corpus.")
        loss = total / count
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)),
                "accuracy": correct / count, "tokens": float(count)}

    def describe(self) -> dict[str, Any]:
        return {"train": len(self.train), "val": len(self.splits["val"]),
                "test": len(self.splits["test"]), "eval_rows": int(self.eval_rows("val").shape[0]),
                "vocab": self.vocab, "seq_len": self.config.seq_len,
                "train_tokens": int(next_token_targets(self.train.ids)[1].ne(IGNORE_INDEX).sum()),
                **{f"{s}_modules": len(d.modules) for s, d in (("train", self.train),
                                                                  *self.splits.items())}}


__all__ = ["LMTask", "LMTaskConfig", "next_token_targets"]
