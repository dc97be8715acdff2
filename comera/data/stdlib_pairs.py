"""A sentence-pair task from real text on every machine: does this docstring describe this code?

The CPython standard library holds thousands of documented functions. Each example pairs a
docstring with a function body: its own (label 1, "matched") or another function's from the
same split (label 0, "mismatched"). Splits are by module (a hash of the module path), so no
function, and no module, lands in two splits. A word-level tokenizer is built locally from the
training split (:mod:`comera.data.tokenizer`); nothing is downloaded. The encoded splits are
cached under the user's cache directory (:mod:`comera.data.cache`).
"""

from __future__ import annotations

import ast
import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from comera.data.cache import cache_dir, cache_file, read_cached, write_cached
from comera.data.tokenizer import CLS, PAD, SEP, SPECIALS, UNK, Tokenizer, tokenize

VERSION = 3
STDLIB_SKIP_DIRS = frozenset(
    {"test", "tests", "idlelib", "site-packages", "pydoc_data", "lib2to3", "turtledemo"})


def split_of(module: str) -> str:
    """The split of a module path: ~80% train, 10% val, 10% test, by a hash of the path."""
    h = int(hashlib.sha256(module.encode()).hexdigest()[:8], 16) % 100
    return "test" if h < 10 else "val" if h < 20 else "train"


def stdlib_functions(root: Path | None = None) -> list[tuple[str, str, str]]:
    """(module, docstring, body source without the docstring) for documented functions."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        if STDLIB_SKIP_DIRS & set(path.relative_to(root).parts[:-1]):
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


def encode_pairs(pairs, tokenizer: Tokenizer, max_len: int) -> PairDataset:
    """(text, text, label) pairs as padded ``[CLS] a [SEP] b [SEP]`` ids with segment ids."""
    ids = torch.full((len(pairs), max_len), PAD, dtype=torch.long)
    seg = torch.zeros((len(pairs), max_len), dtype=torch.long)
    labels = torch.tensor([label for _, _, label in pairs], dtype=torch.long)
    for row, (doc, code, _) in enumerate(pairs):
        tok, s = tokenizer.encode_pair(doc, code, max_len)
        ids[row, : len(tok)] = torch.tensor(tok)
        seg[row, : len(s)] = torch.tensor(s)
    return PairDataset(ids, seg, labels)


def matched_pairs(functions, rng: random.Random):
    """Each function once matched and once with another function's body (label 1 / 0)."""
    out = []
    for k, (_, doc, code) in enumerate(functions):
        out.append((doc, code, 1))
        other = rng.randrange(len(functions) - 1)
        other += other >= k
        out.append((doc, functions[other][2], 0))
    rng.shuffle(out)
    return out


def _decode(blob) -> tuple[PairDataset, PairDataset, PairDataset, Tokenizer]:
    return (*(PairDataset(**blob[s]) for s in ("train", "val", "test")),
            Tokenizer(tuple(blob["vocab"])))


def load_stdlib_pairs(max_len: int = 128, vocab_size: int = 8000, limit: int | None = None,
                      seed: int = 0, use_cache: bool = True):
    """(train, val, test, tokenizer) of the docstring/code matching task (see module doc).

    ``limit`` caps the number of functions per split (for quick runs).
    """
    path = cache_file("stdlib_pairs", VERSION, {"max_len": max_len, "vocab_size": vocab_size,
                                                "limit": limit, "seed": seed})
    cached = read_cached(path, _decode) if use_cache else None
    if cached is not None:
        return cached
    functions = stdlib_functions()
    by_split: dict[str, list] = {"train": [], "val": [], "test": []}
    for fn in functions:
        by_split[split_of(fn[0])].append(fn)
    rng = random.Random(seed)
    if limit is not None:
        for split, items in by_split.items():
            by_split[split] = rng.sample(items, min(limit, len(items)))
    tokenizer = Tokenizer.build((t for _, d, c in by_split["train"] for t in (d, c)), vocab_size)
    data = {s: encode_pairs(matched_pairs(items, rng), tokenizer, max_len)
            for s, items in by_split.items()}
    if use_cache:
        write_cached(path, {"vocab": list(tokenizer.vocab),
                            **{s: {"ids": d.ids, "segments": d.segments, "labels": d.labels}
                               for s, d in data.items()}})
    return data["train"], data["val"], data["test"], tokenizer


__all__ = [  # the tokenizer names and cache_dir are re-exported: they lived here before
    "CLS", "PAD", "SEP", "SPECIALS", "STDLIB_SKIP_DIRS", "UNK", "PairDataset", "Tokenizer",
    "cache_dir", "load_stdlib_pairs", "split_of", "stdlib_functions", "tokenize",
]
