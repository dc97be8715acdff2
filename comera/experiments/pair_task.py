"""The stdlib docstring/code pair task (``comera train transformer-code``), the second
transformer task (see :mod:`comera.experiments.transformer_task`).

Data: :func:`comera.data.load_stdlib_pairs`, "does this docstring describe this code?", from the
CPython standard library, split by module. It is hard for a transformer trained from scratch at
CPU scale (it stays near chance); ``init_from`` starts the encoder from a ``comera train mlm``
checkpoint, the paper's CodeBERT way. The quick configuration is a CPU-sized model (d_model 256,
2 layers) on sequences of 64 tokens; the full one is the paper's (d_model 768, 6 layers, 128).
"""

from __future__ import annotations

from dataclasses import dataclass

from comera.data import load_stdlib_pairs
from comera.experiments.transformer_task import PairClassificationTask, TransformerTaskConfig
from tncomp.extend import renamed


@dataclass(frozen=True)
class CodePairTaskConfig(TransformerTaskConfig):
    """Data and model sizes of the docstring/code pair task."""

    limit: int | None = 3000  # functions per split (None: all of them)
    data_seed: int = 0

    @classmethod
    def full(cls) -> CodePairTaskConfig:
        return cls(max_len=128, limit=None, paper_model=True)


class CodePairTask(PairClassificationTask):
    """Binary docstring/code matching; metric: accuracy."""

    name = "transformer-code"

    def __init__(self, config: CodePairTaskConfig = CodePairTaskConfig()):
        self.config = config
        self.n_classes = 2
        tokenizer, max_len = self._read_pretrained()
        if tokenizer is None:
            self.train, self.val, self.test, self.tokenizer = load_stdlib_pairs(
                max_len, config.vocab_size, config.limit, config.data_seed)
        else:
            self.train, self.val, self.test = _encode_with(tokenizer, max_len, config)
            self.tokenizer = tokenizer


def _encode_with(tokenizer, max_len: int, config: CodePairTaskConfig):
    """The splits of :func:`comera.data.load_stdlib_pairs` (same functions, same pairs), encoded
    with a given tokenizer (a pretrained MLM's)."""
    import random

    from comera.data.stdlib_pairs import encode_pairs, matched_pairs, split_of, stdlib_functions

    by_split: dict[str, list] = {"train": [], "val": [], "test": []}
    for fn in stdlib_functions():
        by_split[split_of(fn[0])].append(fn)
    rng = random.Random(config.data_seed)
    if config.limit is not None:
        for split, items in by_split.items():
            by_split[split] = rng.sample(items, min(config.limit, len(items)))
    return tuple(encode_pairs(matched_pairs(by_split[s], rng), tokenizer, max_len)
                 for s in ("train", "val", "test"))


#: The names before the reviews task became the default transformer task: warned until 0.3.0.
__getattr__ = renamed(__name__, {"PairTask": (f"{__name__}:CodePairTask", "0.3.0"),
                                 "PairTaskConfig": (f"{__name__}:CodePairTaskConfig", "0.3.0")})
