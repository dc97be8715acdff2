"""A sentence-pair task from real text on every machine: does this docstring describe this code?

The CPython standard library holds thousands of documented functions. Each example pairs a
docstring with a function body: its own (label 1, "matched") or another function's from the
same split (label 0, "mismatched"). Splits are by module (a hash of the module path), so no
function, and no module, lands in two splits. A word-level tokenizer is built locally from the
training split; nothing is downloaded. The encoded splits are cached under the user's cache
directory.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import os
import random
import re
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from tncomp.files import user_cache_dir

log = logging.getLogger("comera.data")

VERSION = 3
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")
PAD, UNK, CLS, SEP = range(4)
# words and identifier pieces: ``get_path`` and ``getPath`` both give "get", "path", so code shares
# its vocabulary with the prose that describes it; underscores are separators, not tokens
_TOKEN = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+|[^\sA-Za-z\d_]")
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "pydoc_data", "lib2to3", "turtledemo"}


def cache_dir() -> Path:
    """``$COMERA_CACHE_DIR``, else the user cache directory."""
    return user_cache_dir("comera", "COMERA_CACHE_DIR")


def _split_of(module: str) -> str:
    h = int(hashlib.sha256(module.encode()).hexdigest()[:8], 16) % 100
    return "test" if h < 10 else "val" if h < 20 else "train"


def stdlib_functions(root: Path | None = None) -> list[tuple[str, str, str]]:
    """(module, docstring, body source without the docstring) for documented functions."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        if _SKIP_DIRS & set(path.relative_to(root).parts[:-1]):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        module = str(path.relative_to(root))
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(node.body) < 2:
                continue
            body = "\n".join(lines[node.body[1].lineno - 1: node.end_lineno])
            if body.strip():
                signature = f"def {node.name}({ast.unparse(node.args)}):"
                out.append((module, doc.strip(), f"{signature}\n{body}"))
    return out


def tokenize(text: str) -> list[str]:
    return [t.lower() for t in _TOKEN.findall(text)]


@dataclass(frozen=True)
class Tokenizer:
    """Word-level vocabulary built from the training split (specials first)."""

    vocab: tuple[str, ...]

    @classmethod
    def build(cls, texts, size: int) -> Tokenizer:
        counts = Counter(tok for text in texts for tok in tokenize(text))
        words = [w for w, _ in counts.most_common(size - len(SPECIALS))]
        return cls(SPECIALS + tuple(words))

    def ids(self, text: str, limit: int) -> list[int]:
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


@dataclass(frozen=True)
class PairDataset:
    """Padded token ids, segment ids and labels of one split."""

    ids: torch.Tensor  # (N, max_len) int64, PAD = 0
    segments: torch.Tensor  # (N, max_len) int64
    labels: torch.Tensor  # (N,) int64: 1 matched, 0 mismatched

    def __len__(self) -> int:
        return self.labels.numel()

    def batches(self, batch_size: int, shuffle: bool, seed: int = 0):
        order = (torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
                 if shuffle else torch.arange(len(self)))
        for start in range(0, len(self), batch_size):
            idx = order[start:start + batch_size]
            yield self.ids[idx], self.segments[idx], self.labels[idx]


def _encode(pairs, tokenizer: Tokenizer, max_len: int) -> PairDataset:
    ids = torch.full((len(pairs), max_len), PAD, dtype=torch.long)
    seg = torch.zeros((len(pairs), max_len), dtype=torch.long)
    labels = torch.tensor([label for _, _, label in pairs], dtype=torch.long)
    for row, (doc, code, _) in enumerate(pairs):
        tok, s = tokenizer.encode_pair(doc, code, max_len)
        ids[row, : len(tok)] = torch.tensor(tok)
        seg[row, : len(s)] = torch.tensor(s)
    return PairDataset(ids, seg, labels)


def _pairs(functions, rng: random.Random):
    """Each function once matched and once with another function's body (label 1 / 0)."""
    out = []
    for k, (_, doc, code) in enumerate(functions):
        out.append((doc, code, 1))
        other = rng.randrange(len(functions) - 1)
        other += other >= k
        out.append((doc, functions[other][2], 0))
    rng.shuffle(out)
    return out


def load_stdlib_pairs(max_len: int = 128, vocab_size: int = 8000, limit: int | None = None,
                      seed: int = 0, use_cache: bool = True):
    """(train, val, test, tokenizer) of the docstring/code matching task (see module doc).

    ``limit`` caps the number of functions per split (for quick runs).
    """
    key = f"stdlib_pairs-v{VERSION}-{max_len}-{vocab_size}-{limit}-{seed}.pt"
    path = cache_dir() / key
    if use_cache and path.is_file():
        try:
            blob = torch.load(path, weights_only=False)
            return (*(PairDataset(**blob[s]) for s in ("train", "val", "test")),
                    Tokenizer(tuple(blob["vocab"])))
        except Exception as exc:  # a corrupt cache entry is rebuilt, not trusted
            log.warning("rebuilding corrupt data cache %s (%s)", path, exc)
    functions = stdlib_functions()
    by_split: dict[str, list] = {"train": [], "val": [], "test": []}
    for fn in functions:
        by_split[_split_of(fn[0])].append(fn)
    rng = random.Random(seed)
    if limit is not None:
        for split, items in by_split.items():
            by_split[split] = rng.sample(items, min(limit, len(items)))
    tokenizer = Tokenizer.build((t for _, d, c in by_split["train"] for t in (d, c)), vocab_size)
    data = {s: _encode(_pairs(items, rng), tokenizer, max_len) for s, items in by_split.items()}
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"vocab": list(tokenizer.vocab),
                    **{s: {"ids": d.ids, "segments": d.segments, "labels": d.labels}
                       for s, d in data.items()}}, tmp)
        os.replace(tmp, path)
    return data["train"], data["val"], data["test"], tokenizer
