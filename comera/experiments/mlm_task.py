"""Masked-language-model pretraining (the paper's CodeBERT-like run) on the stdlib corpus.

    task = MLMTask(MLMTaskConfig())          # quick: d_model 128, 2 layers, 64 tokens
    model = task.build_model()               # encoder layers and token table TT-matrix
    inputs, labels = task.batch(indices)     # BERT masks of (seed, example, epoch)
    loss = task.loss(model, (inputs, labels))

The metric is the masked-token cross-entropy on fixed validation masks (lower is better);
``evaluate`` also reports masked-token accuracy and perplexity.

Masks are a function of (seed, example index, epoch). ``batch(indices, epochs)`` takes the epoch
of each example; an engine gets it from its :class:`~comera.experiments.task.IndexStream` with
:func:`step_epochs`. Without ``epochs`` the task counts how often it has served each example,
which equals the epoch in an uninterrupted single-process run (each epoch is a permutation);
save and restore that count with ``state_dict`` / ``load_state_dict`` to resume exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from comera import ConfigError
from comera.data import BertMasking
from comera.data.stdlib_corpus import load_corpus_splits
from comera.experiments.task import IndexStream, Task, model_format, spread_subset
from comera.experiments.task_config import check_corpus_settings, holds_model
from comera.formats.registry import DENSE
from comera.layers.linear import FRESH_FORMAT
from comera.models import MaskedLM, TransformerConfig
from comera.models.mlm import masked_logits
from comera.models.transformer import linear_layer
from comera.numbers import is_int

EVAL_SPLITS = ("val", "test")
_BLOCK_LINEARS = ("attn.q", "attn.k", "attn.v", "attn.o", "ffn_in", "ffn_out")
#: the quick run's model: max TT rank 32 for the encoder and head linear layers and 64 for the
#: token table and the vocabulary projection (the quick run's loss is far more sensitive to the
#: latter); every modes None, so factorised from the sizes
QUICK_MODEL = TransformerConfig(vocab_size=8192, d_model=128, n_heads=4, d_ff=512, n_layers=2,
                                max_len=64, dropout=0.1, rank=32, embedding_rank=64,
                                attn_modes=None, ffn_in_modes=None, ffn_out_modes=None,
                                embedding_modes=None)


@holds_model(follows={"max_len": "seq_len"}, not_flat=("linear_format", "n_classes"))
@dataclass(frozen=True)
class MLMTaskConfig:
    """The model's config (:class:`TransformerConfig`) and the data, masking and scoring settings
    around it. The defaults are the quick run (about a minute or two of training per model on
    two CPU cores); :meth:`full` is the paper's encoder size.

    The model's sizes are its config's fields, read and set here by name too
    (``MLMTaskConfig(d_model=256).d_model``; :mod:`comera.experiments.task_config`). Its
    ``max_len`` is ``seq_len`` and the layer kind is each build's (``build_model(format)``), so
    ``model.linear_format`` is not read, nor ``model.n_classes`` (an MLM has no classes);
    ``model.vocab_size`` is the vocabulary asked of the tokenizer, the built model takes the size
    it got. The default model's modes are None: factorised from the sizes."""

    model: TransformerConfig = QUICK_MODEL
    quick: bool = True
    seq_len: int = 64
    mask_prob: float = 0.15
    eval_limit: int | None = 1024  # sequences of val/test scored (a fixed spread-out subset)
    eval_batch_size: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        check_corpus_settings(self.seq_len, self.eval_limit, self.eval_batch_size, "sequences")

    @classmethod
    def full(cls) -> MLMTaskConfig:
        """d_model 768, 12 heads, FFN 3072, 6 layers, 128 tokens; ranks 30 / 32 as the paper."""
        model = replace(QUICK_MODEL, vocab_size=16384, d_model=768, n_heads=12, d_ff=3072,
                        n_layers=6, rank=30, embedding_rank=32)
        return cls(model, quick=False, seq_len=128, eval_limit=None)

    def model_config(self, vocab_size: int, format: str = FRESH_FORMAT) -> TransformerConfig:
        """The :class:`TransformerConfig` of the MLM with ``vocab_size`` tokens and its layers of
        the kind ``format`` ("dense" or a registered format)."""
        return replace(self.model, vocab_size=vocab_size, linear_format=model_format(format))


def step_epochs(stream: IndexStream, step: int, rank: int = 0, world: int = 1) -> Tensor:
    """The epoch of each example of ``stream.shard(step, rank, world)`` (int64, aligned)."""
    return stream.epochs(step, rank, world)


class MLMTask(Task):
    """BERT masked-LM on the stdlib corpus; metric: masked-token loss on fixed val masks."""

    name = "mlm"
    metric = "loss"
    higher_is_better = False
    # TT-matrix: at the quick run's 8x it ends closer to dense than TT
    # (benchmarks/results/quick_defaults)
    recommended_format = FRESH_FORMAT

    def __init__(self, config: MLMTaskConfig | None = None, root: Path | str | None = None,
                 use_cache: bool = True):
        self.config = config if config is not None else MLMTaskConfig()
        c = self.config
        self.train, self.splits, self.tokenizer = load_corpus_splits(
            c.seq_len, c.vocab_size, root=root, use_cache=use_cache)
        self.vocab = len(self.tokenizer.vocab)
        self.masking = BertMasking(self.vocab, prob=c.mask_prob)
        self._served = [0] * len(self.train)  # times each example was served (see module doc)
        self._eval: dict[str, tuple[Tensor, Tensor]] = {}

    # -- Task protocol ------------------------------------------------------------------------
    def build_model(self, format: str = FRESH_FORMAT) -> nn.Module:
        """The MLM of the CoMERA run (encoder layers and token table in ``format``, by default
        the task's :attr:`recommended_format`) or the dense one (``"dense"``)."""
        return MaskedLM(self.config.model_config(self.vocab, format))

    def build(self, format: str = "dense", rank: int | None = None, **sizes: int) -> MaskedLM:
        """The MLM with dense token table and head, and encoder block linear layers of the kind
        ``format`` ("dense" or a registered format, biases kept) at ``rank`` (default: the
        config's max rank), initialised from the current RNG (the dense model first, then the
        block layers): the model a compression frontier compares at matched size of
        :meth:`block_linears`. ``sizes``: other model sizes of the config (``d_model``,
        ``d_ff``, ...: a narrower model on the same data)."""
        format = model_format(format)
        config = replace(self.config, **sizes) if sizes else self.config
        rank = self.config.rank if rank is None else rank
        if not is_int(rank):
            raise ConfigError(f"rank={rank!r}; give a rank >= 1.")
        model = MaskedLM(config.model_config(self.vocab, DENSE))
        if format == DENSE:
            return model
        for name, layer in self.block_linears(model):
            new = linear_layer(format, layer.in_features, layer.out_features, rank,
                               tau=model.cfg.tau, parametrization=model.cfg.parametrization)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, new)
        return model

    @staticmethod
    def block_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
        """(name, layer) of every encoder block linear layer: the layers a frontier
        compresses."""
        return [(f"blocks.{i}.{n}", block.get_submodule(n))
                for i, block in enumerate(model.blocks) for n in _BLOCK_LINEARS]

    def train_size(self) -> int:
        return len(self.train)

    def batch(self, indices: Tensor, epochs: Tensor | int | None = None) -> tuple[Tensor, Tensor]:
        """(inputs, labels), each (b, seq_len): masked ids, and -100 where nothing is predicted.

        ``epochs``: the epoch of each example (or one for all); None counts occurrences.
        """
        indices = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= len(self.train)):
            raise ConfigError(f"example indices span [{int(indices.min())}, "
                              f"{int(indices.max())}]; the training split has "
                              f"{len(self.train)} examples.")
        if epochs is None:
            served = []
            for i in indices.tolist():
                served.append(self._served[i])
                self._served[i] += 1
            epochs = torch.tensor(served, dtype=torch.long)
        return self.masking(self.train.ids[indices], indices, epochs, self.config.seed)

    def step_batch(self, stream: IndexStream, step: int, rank: int = 0,
                   world: int = 1) -> tuple[Tensor, Tensor]:
        """The batch of ``step`` with each example masked for its epoch (resume-exact)."""
        return self.batch(stream.shard(step, rank, world), stream.epochs(step, rank, world))

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        logits, targets = masked_logits(model, *batch)  # (n, V), (n,)
        return nn.functional.cross_entropy(logits, targets)

    def eval_batch(self, split: str) -> tuple[Tensor, Tensor]:
        """The fixed (inputs, labels) that ``evaluate`` scores on ``split``: epoch 0 masks of a
        spread-out subset of ``eval_limit`` sequences."""
        if split not in self.splits:
            raise ConfigError(f"split {split!r}; choose one of {', '.join(EVAL_SPLITS)}.")
        if split not in self._eval:
            data = self.splits[split]
            subset = spread_subset(len(data), self.config.eval_limit, self.config.seed)
            self._eval[split] = self.masking(data.ids[subset], subset, 0, self.config.seed)
        return self._eval[split]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        inputs, labels = self.eval_batch(split)
        device = next(model.parameters()).device
        total, correct, count = 0.0, 0, 0
        size = self.config.eval_batch_size
        for start in range(0, inputs.shape[0], size):
            ids = inputs[start:start + size].to(device)
            lab = labels[start:start + size].to(device)
            if not bool((lab != -100).any()):
                continue
            logits, targets = masked_logits(model, ids, lab)  # (n, V), (n,)
            total += float(nn.functional.cross_entropy(logits, targets, reduction="sum"))
            correct += int((logits.argmax(1) == targets).sum())
            count += targets.numel()
        loss = total / max(count, 1)
        return {"loss": loss, "accuracy": correct / max(count, 1),
                "perplexity": math.exp(min(loss, 50.0)), "tokens": float(count)}

    def describe(self) -> dict[str, Any]:
        inputs, _ = self.eval_batch("val")
        return {"train": len(self.train), "val": len(self.splits["val"]),
                "test": len(self.splits["test"]), "eval_sequences": inputs.shape[0],
                "vocab": self.vocab, "seq_len": self.config.seq_len,
                "train_tokens": int((self.train.ids >= self.masking.first_word).sum())}

    # -- resumable occurrence counts ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The per-example occurrence counts behind ``batch(indices)`` without ``epochs``."""
        return {"served": list(self._served)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        served = list(state["served"])
        if len(served) != len(self.train):
            raise ConfigError(f"the state counts {len(served)} examples; this task's training "
                              f"split has {len(self.train)} (a different corpus or seq_len?).")
        self._served = served
