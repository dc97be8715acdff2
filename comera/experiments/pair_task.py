"""The paper's six-encoder transformer on a sentence-pair task (the stand-in for MNLI).

Data: :func:`comera.data.load_stdlib_pairs`, "does this docstring describe this code?", from the
CPython standard library, split by module. Model: :class:`comera.models.PairClassifier`, every
linear layer and the token embedding as TT layers (or dense, for the baseline). The quick
configuration is a CPU-sized model (d_model 256, 2 layers) on sequences of 64 tokens; the full
one is the paper's (d_model 768, 6 layers, 128 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from comera.data import load_stdlib_pairs
from comera.experiments.task import Task
from comera.models import PairClassifier, TransformerConfig


@dataclass(frozen=True)
class PairTaskConfig:
    """Data and model sizes of the pair task."""

    max_len: int = 64
    vocab_size: int = 8000
    limit: int | None = 3000  # functions per split (None: all of them)
    paper_model: bool = False  # True: d_model 768, 6 layers (the paper's); False: CPU-sized
    rank: int | None = None  # TT rank of the linear layers (default: the model config's)
    dropout: float = 0.1
    data_seed: int = 0
    eval_batch: int = 256

    @classmethod
    def full(cls) -> PairTaskConfig:
        return cls(max_len=128, limit=None, paper_model=True)


class PairTask(Task):
    """Binary pair classification; metric: accuracy."""

    name = "transformer"
    metric = "accuracy"

    def __init__(self, config: PairTaskConfig = PairTaskConfig()):
        self.config = config
        self.train, self.val, self.test, self.tokenizer = load_stdlib_pairs(
            config.max_len, config.vocab_size, config.limit, config.data_seed)

    def model_config(self, tt: bool) -> TransformerConfig:
        c = self.config
        changes: dict[str, Any] = dict(max_len=c.max_len, n_classes=2, tt=tt, tt_embedding=tt,
                                       dropout=c.dropout)
        if c.rank is not None:
            changes["rank"] = c.rank
        vocab = len(self.tokenizer.vocab)
        if c.paper_model:
            return TransformerConfig(vocab_size=vocab, **changes)
        return TransformerConfig.small(vocab, **changes)

    def build_model(self, tt: bool) -> nn.Module:
        return PairClassifier(self.model_config(tt))

    def train_size(self) -> int:
        return len(self.train)

    def batch(self, indices: Tensor):
        return self.train.ids[indices], self.train.segments[indices], self.train.labels[indices]

    def loss(self, model: nn.Module, batch) -> Tensor:
        ids, segments, labels = batch
        return nn.functional.cross_entropy(model(ids, segments), labels)

    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        data = {"val": self.val, "test": self.test}[split]
        device = next(model.parameters()).device
        correct, loss_sum = 0, 0.0
        for ids, seg, labels in data.batches(self.config.eval_batch, shuffle=False):
            ids, seg, labels = ids.to(device), seg.to(device), labels.to(device)
            logits = model(ids, seg)  # (b, 2)
            loss_sum += float(nn.functional.cross_entropy(logits, labels, reduction="sum"))
            correct += int((logits.argmax(1) == labels).sum())
        n = max(len(data), 1)
        return {"accuracy": correct / n, "loss": loss_sum / n}

    def describe(self) -> dict[str, Any]:
        return {"train": len(self.train), "val": len(self.val), "test": len(self.test),
                "vocab": len(self.tokenizer.vocab), "max_len": self.config.max_len,
                "positives": float(self.train.labels.float().mean())}

