"""``--init-from CKPT``: start a pair classifier from a ``comera train mlm`` checkpoint.

The masked-LM (:class:`comera.models.MaskedLM`) and the pair classifier
(:class:`comera.models.PairClassifier`) share their encoder: token table, positions, LayerNorm
and encoder blocks. :func:`read_pretrained` rebuilds the MLM the checkpoint was trained as (its
:class:`~comera.experiments.mlm_task.MLMTaskConfig` is recognised from the saved shapes, TT or
dense from the engine's record) and loads it with :func:`comera.load_checkpoint`, so a TT
encoder comes back at the ranks it was saved with. :func:`load_encoder_` moves those modules into
the classifier; the segment embedding starts at zero (so the first forward sees the pretrained
input distribution) and the head is fresh. The classifier must read its text with the MLM's
tokenizer and at most its sequence length: :class:`Pretrained` carries both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from comera.data.stdlib_pairs import Tokenizer
from comera.errors import CheckpointError
from comera.experiments.engine import engine_state_format
from comera.models import MaskedLM, TransformerConfig
from comera.surgery.checkpoint import load_checkpoint
from comera.torchfile import read_torch_file

ENCODER = ("tokens", "positions", "ln", "blocks")


@dataclass(frozen=True)
class Pretrained:
    """A loaded MLM, its model config and tokenizer."""

    model: MaskedLM
    config: TransformerConfig
    tokenizer: Tokenizer

    @property
    def max_len(self) -> int:
        return self.config.max_len


def _engine_state(path: Path) -> dict:
    try:
        payload = read_torch_file(path)
    except FileNotFoundError:
        raise CheckpointError(f"--init-from {path}: no such file; give a checkpoint written by "
                              "`comera train mlm` (runs/<out>/checkpoints/comera.pt).") from None
    except Exception as exc:
        raise CheckpointError(f"--init-from {path}: not a readable checkpoint ({exc}).") from None
    engine = payload.get("extra", {}).get("engine") if isinstance(payload, dict) else None
    if not isinstance(engine, dict) or engine.get("task") != "mlm":
        task = engine.get("task") if isinstance(engine, dict) else None
        raise CheckpointError(f"--init-from {path}: a checkpoint of task {task!r}; it must be "
                              "one written by `comera train mlm`.")
    format = engine_state_format(engine)  # a state of the tt flag's era: TT or dense
    if format is None:
        raise CheckpointError(f"--init-from {path}: its engine state names no layer kind; the "
                              "file is damaged or was edited: give a checkpoint written by "
                              "`comera train mlm`.")
    return {"format": format, "state": payload["model"]}


def read_pretrained(path: Path | str, task_config=None, root: Path | str | None = None,
                    use_cache: bool = True) -> Pretrained:
    """The MLM saved at ``path`` (TT or dense, ranks as saved), its config and tokenizer.

    ``task_config``: the run's :class:`~comera.experiments.mlm_task.MLMTaskConfig` (default:
    the quick or full one, recognised from the saved shapes); ``root``: the corpus it was
    trained on (default: the standard library), whose tokenizer the classifier must use.
    """
    from comera.data.stdlib_corpus import load_stdlib_corpus
    from comera.experiments.mlm_task import MLMTaskConfig

    path = Path(path)
    saved = _engine_state(path)
    state = saved["state"]
    positions = state.get("positions.weight")
    n_layers = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    if positions is None:
        raise CheckpointError(f"--init-from {path}: no positions table in the checkpoint.")
    shape = (positions.shape[0], positions.shape[1], n_layers)
    known = [c for c in ((task_config,) if task_config is not None
                         else (MLMTaskConfig(), MLMTaskConfig.full()))
             if (c.seq_len, c.d_model, c.n_layers) == shape]
    if not known:
        raise CheckpointError(f"--init-from {path}: an MLM of (seq_len, d_model, layers) "
                              f"{shape}; known are the quick and full `comera train mlm` models.")
    task_config = known[0]
    _, _, _, tokenizer = load_stdlib_corpus(task_config.seq_len, task_config.vocab_size,
                                            root=root, use_cache=use_cache)
    config = task_config.model_config(len(tokenizer.vocab), saved["format"])
    model = MaskedLM(config)
    load_checkpoint(path, model)
    return Pretrained(model, config, tokenizer)


def classifier_config(pretrained: Pretrained, n_classes: int, dropout: float) -> TransformerConfig:
    """The pair classifier's config: the MLM's encoder with a head of ``n_classes``."""
    return replace(pretrained.config, n_classes=n_classes, dropout=dropout)


def load_encoder_(classifier: nn.Module, pretrained: Pretrained) -> nn.Module:
    """Put the MLM's encoder modules (copies) into ``classifier``; zero its segment table."""
    import copy

    for name in ENCODER:
        mine, theirs = getattr(classifier, name), getattr(pretrained.model, name)
        if type(mine) is not type(theirs) and not isinstance(mine, nn.ModuleList):
            raise CheckpointError(f"the classifier's {name} is a {type(mine).__name__}, the "
                                  f"MLM's a {type(theirs).__name__}: build the classifier with "
                                  "classifier_config(pretrained, ...).")
        setattr(classifier, name, copy.deepcopy(theirs))
    with torch.no_grad():
        classifier.segments.weight.zero_()
    return classifier
