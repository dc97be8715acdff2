"""The word-level tokenizer every text loader shares, and its special tokens.

Words and identifier pieces are tokens: ``get_path`` and ``getPath`` both give "get", "path", so
code shares its vocabulary with the prose that describes it; underscores are separators, not
tokens. A :class:`Tokenizer` is a vocabulary (specials first, then words by frequency) built
locally from a training split; nothing is downloaded.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")
PAD, UNK, CLS, SEP = range(4)
_TOKEN = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+|[^\sA-Za-z\d_]")


def tokenize(text: str) -> list[str]:
    """The lower-cased word, number and punctuation tokens of ``text``."""
    return [t.lower() for t in _TOKEN.findall(text)]


@dataclass(frozen=True)
class Tokenizer:
    """Word-level vocabulary built from the training split (specials first)."""

    vocab: tuple[str, ...]

    @classmethod
    def build(cls, texts: Iterable[str], size: int) -> Tokenizer:
        """The ``size - 4`` most frequent tokens of ``texts`` after the four specials."""
        counts = Counter(tok for text in texts for tok in tokenize(text))
        words = [w for w, _ in counts.most_common(size - len(SPECIALS))]
        return cls(SPECIALS + tuple(words))

    def ids(self, text: str, limit: int) -> list[int]:
        """The ids of the first ``limit`` tokens of ``text`` (``[UNK]`` for unknown words)."""
        index = self._index
        return [index.get(t, UNK) for t in tokenize(text)[:limit]]

    @property
    def _index(self) -> dict[str, int]:
        cached = self.__dict__.get("_index_cache")
        if cached is None:
            cached = {w: k for k, w in enumerate(self.vocab)}
            object.__setattr__(self, "_index_cache", cached)
        return cached

    def encode_pair(self, first: str, second: str, max_len: int) -> tuple[list[int], list[int]]:
        """[CLS] first [SEP] second [SEP], truncated to ``max_len``; segment ids 0/1."""
        budget = max_len - 3
        a = self.ids(first, budget // 2)
        b = self.ids(second, budget - len(a))
        ids = [CLS, *a, SEP, *b, SEP]
        segments = [0] * (len(a) + 2) + [1] * (len(b) + 1)
        return ids, segments


__all__ = ["CLS", "PAD", "SEP", "SPECIALS", "UNK", "Tokenizer", "tokenize"]
