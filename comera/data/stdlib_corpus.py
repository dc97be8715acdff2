"""A masked-language-model corpus from real code on every machine: the CPython standard library.

Which files: every ``.py`` file under the stdlib root except (see :func:`skip_reason`)

1. files under a test, tool or vendored folder (``test``, ``tests``, ``idlelib``,
   ``site-packages``, ``pydoc_data``, ``lib2to3``, ``turtledemo``), and ``encodings`` (codec
   tables, and dozens of per-codec files that differ only in their name);
2. test files by name (``test_*.py``, ``*_test.py``) and data files by name (``_*data*.py``,
   e.g. ``_sysconfigdata_*.py``);
3. generated files: a marker (``auto-generated``, ``automatically generated``, ``generated
   by``/``from``/``and used``, ``do not edit``) in the first five lines;
4. files with a line longer than 1,000 characters (minified or machine-written);
5. files that do not parse or decode as UTF-8;
6. data-only files: more than half of their non-blank lines lie inside multi-line literal tables
   (lists, tuples, sets and dicts of constants, or strings that are not docstrings), e.g.
   ``html/entities.py``, ``locale.py``'s alias tables, ``stringprep.py``.

Splits are by module with the hash rule of :mod:`comera.data.stdlib_pairs`, so no file lands in
two splits. A word-level :class:`~comera.data.tokenizer.Tokenizer` is built on the training
split, with ``[MASK]`` (id 4) added after the four shared specials. Each file's tokens are cut
into pieces of ``seq_len - 2`` and framed as ``[CLS] piece [SEP]`` (a short last piece is padded;
one under ``min_tokens`` is dropped), so no sequence mixes two files. The encoded splits are cached
under :func:`~comera.data.cache.cache_dir`, keyed by every parameter, the format version and
a fingerprint of the source files.

:class:`BertMasking` masks a batch as a pure function of (seed, example index, epoch), so a
resumed run, or one whose batches are shuffled differently, sees the same masks per example.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import os
import re
import sys
import sysconfig
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

import torch
from rich.progress import Progress
from torch import Tensor

from comera.data.cache import cache_file, read_cached, write_cached
from comera.data.progress import preparing_progress, progress_enabled  # noqa: F401 (re-exported)
from comera.data.stdlib_pairs import STDLIB_SKIP_DIRS, split_of
from comera.data.tokenizer import CLS, PAD, SEP, SPECIALS, Tokenizer
from comera.errors import ConfigError
from comera.numbers import is_int

log = logging.getLogger("comera.data")

VERSION = 1
MASK_TOKEN = "[MASK]"
MASK = len(SPECIALS)  # 4: the id of [MASK], right after [PAD] [UNK] [CLS] [SEP]
FIRST_WORD = MASK + 1  # ids below this are special: never masked, never drawn as replacements
IGNORE_INDEX = -100  # the label of positions that are not predicted (torch's cross_entropy default)
SPLITS = ("train", "val", "test")

SKIP_DIRS = frozenset(STDLIB_SKIP_DIRS | {"encodings"})
SKIP_NAMES = ("test_*.py", "*_test.py", "_*data*.py")
_GENERATED = re.compile(
    r"auto-?generated|automatically generated|generated (by|from|and used)|do not edit", re.I)
_MAX_LINE = 1000
_MAX_LITERAL_SHARE = 0.5


# -- which files ----------------------------------------------------------------------------------
def _is_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant):
        return True  # -1
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return all(_is_literal(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return (all(k is not None and _is_literal(k) for k in node.keys)
                and all(_is_literal(v) for v in node.values))
    return False


def literal_share(tree: ast.Module, lines: list[str]) -> float:
    """Share of the non-blank lines inside multi-line literal tables (see the module doc).

    Only multi-line nodes are visited, which skips most of a code file's tree.
    """
    docstrings: set[int] = set()
    covered: set[int] = set()
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        start, end = getattr(node, "lineno", 0), getattr(node, "end_lineno", None) or 0
        if isinstance(node, ast.expr):
            if end == start:
                continue
            if id(node) not in docstrings and _is_literal(node):
                covered.update(range(start, end + 1))
                continue
        elif isinstance(node, ast.stmt) and end == start:
            continue
        body = getattr(node, "body", None)
        if (isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)):
            docstrings.add(id(body[0].value))
        stack.extend(ast.iter_child_nodes(node))
    literal = sum(1 for k in covered if lines[k - 1].strip())
    return literal / max(sum(1 for line in lines if line.strip()), 1)


def _path_reason(module: str) -> str | None:
    parts = Path(module).parts
    folders = SKIP_DIRS.intersection(parts[:-1])
    if folders:
        return f"in folder {sorted(folders)[0]!r}"
    for pattern in SKIP_NAMES:
        if fnmatchcase(parts[-1], pattern):
            return f"name matches {pattern!r}"
    return None


def skip_reason(module: str, source: str | None) -> str | None:
    """Why the file ``module`` (a path relative to the stdlib root) is left out, or None.

    ``source`` None means the file could not be read as UTF-8.
    """
    reason = _path_reason(module)
    if reason is not None:
        return reason
    if source is None:
        return "not UTF-8"
    lines = source.splitlines()
    if any(_GENERATED.search(line) for line in lines[:5]):
        return "generated (marker in the first 5 lines)"
    if any(len(line) > _MAX_LINE for line in lines):
        return f"a line longer than {_MAX_LINE} characters"
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return "does not parse"
    share = literal_share(tree, lines)
    if share > _MAX_LITERAL_SHARE:
        return f"data-only ({share:.0%} of its lines are literal tables)"
    return None


def _candidates(root: Path) -> list[Path]:
    """The ``.py`` files under ``root`` outside :data:`SKIP_DIRS`, sorted (those folders are
    not even walked: the stdlib's ``site-packages`` alone can hold thousands of files)."""
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        out += [Path(folder, f) for f in files if f.endswith(".py")]
    return sorted(p for p in out if p.is_file())


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def corpus_sources(root: Path | str | None = None, progress: Progress | None = None
                   ) -> list[tuple[str, str]]:
    """(module, source) of every kept file under ``root`` (default: this Python's stdlib)."""
    root = _stdlib_root(root)
    files = _candidates(root)
    task = progress.add_task("stdlib corpus: reading files", total=len(files)) if progress else None
    out = []
    for path in files:
        module = path.relative_to(root).as_posix()
        source = None if _path_reason(module) else _read(path)
        reason = skip_reason(module, source)
        if reason is None:
            out.append((module, source))
        else:
            log.debug("corpus: skip %s: %s", module, reason)
        if progress is not None:
            progress.advance(task)
    log.info("stdlib corpus: %d of %d files kept under %s", len(out), len(files), root)
    return out


def _stdlib_root(root: Path | str | None) -> Path:
    root = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ConfigError(f"corpus root {str(root)!r} is not a directory; pass a folder of "
                          ".py files (default: the standard library of this Python).")
    return root


# -- the corpus -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class MLMCorpus:
    """The framed token sequences of one split and the module each came from."""

    ids: Tensor  # (N, seq_len) int64: [CLS] tokens [SEP] [PAD]...
    source: Tensor  # (N,) int64: index into ``modules``
    modules: tuple[str, ...]  # the files of this split, as paths relative to the root

    def __len__(self) -> int:
        return self.ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.ids.shape[1]


def build_mlm_tokenizer(texts, vocab_size: int) -> Tokenizer:
    """``Tokenizer.build`` on ``texts`` with ``[MASK]`` inserted at id :data:`MASK`.

    The vocabulary holds at most ``vocab_size`` entries (fewer when the texts have fewer words).
    """
    if vocab_size <= FIRST_WORD:
        raise ConfigError(f"vocab_size={vocab_size}; it must exceed the {FIRST_WORD} special "
                          "tokens ([PAD] [UNK] [CLS] [SEP] [MASK]).")
    base = Tokenizer.build(texts, vocab_size - 1)
    words = base.vocab[len(SPECIALS):]
    return Tokenizer((*SPECIALS, MASK_TOKEN, *words))


def frame(token_ids: list[int], seq_len: int, min_tokens: int) -> list[list[int]]:
    """Cut one file's ids into ``[CLS] piece [SEP]`` rows of ``seq_len`` (PAD-filled); pieces
    shorter than ``min(min_tokens, seq_len - 2)`` are dropped."""
    width = seq_len - 2
    keep = min(min_tokens, width)
    rows = []
    for start in range(0, len(token_ids), width):
        piece = token_ids[start:start + width]
        if len(piece) >= keep:
            rows.append([CLS, *piece, SEP] + [PAD] * (width - len(piece)))
    return rows


def encode_corpus(sources: list[tuple[str, str]], tokenizer: Tokenizer, seq_len: int,
                  min_tokens: int, progress: Progress | None = None,
                  description: str = "encoding") -> MLMCorpus:
    """Frame every (module, source) of one split into rows (see :func:`frame`)."""
    task = progress.add_task(description, total=len(sources)) if progress else None
    rows: list[list[int]] = []
    source_ids: list[int] = []
    for k, (_, text) in enumerate(sources):
        framed = frame(tokenizer.ids(text, len(text)), seq_len, min_tokens)
        rows += framed
        source_ids += [k] * len(framed)
        if progress is not None:
            progress.advance(task)
    ids = torch.tensor(rows, dtype=torch.long).reshape(len(rows), seq_len)  # (N, seq_len)
    return MLMCorpus(ids, torch.tensor(source_ids, dtype=torch.long),
                     tuple(m for m, _ in sources))


def _fingerprint(root: Path) -> str:
    """Changes when a candidate file is added, removed or resized, or Python's version moves."""
    h = hashlib.sha256(f"{sys.version_info[:2]}|{root.resolve()}".encode())
    for path in _candidates(root):
        h.update(f"{path.relative_to(root).as_posix()}:{path.stat().st_size};".encode())
    return h.hexdigest()[:16]


def _check_params(seq_len: int, vocab_size: int, min_tokens: int) -> None:
    if not is_int(seq_len, 3):
        raise ConfigError(f"seq_len={seq_len!r}; a sequence holds [CLS], at least one token "
                          "and [SEP], so seq_len >= 3.")
    if not is_int(min_tokens):
        raise ConfigError(f"min_tokens={min_tokens!r}; it must be an int >= 1.")
    if not is_int(vocab_size, None):
        raise ConfigError(f"vocab_size={vocab_size!r}; it must be an int.")


def load_stdlib_corpus(seq_len: int = 64, vocab_size: int = 8192, min_tokens: int = 16,
                       root: Path | str | None = None, use_cache: bool = True
                       ) -> tuple[MLMCorpus, MLMCorpus, MLMCorpus, Tokenizer]:
    """(train, val, test, tokenizer) of the stdlib MLM corpus (see the module doc).

    ``root``: a folder of ``.py`` files to read instead of the standard library.
    """
    _check_params(seq_len, vocab_size, min_tokens)
    root = _stdlib_root(root)
    path = cache_file("stdlib_corpus", VERSION, {"sources": _fingerprint(root),
                                                 "seq_len": seq_len, "vocab_size": vocab_size,
                                                 "min_tokens": min_tokens})
    cached = read_cached(path, _decode) if use_cache else None
    if cached is not None:
        return cached
    splits, tokenizer = _build(root, seq_len, vocab_size, min_tokens)
    if use_cache:
        write_cached(path, {"vocab": list(tokenizer.vocab),
                            **{s: {"ids": c.ids, "source": c.source, "modules": list(c.modules)}
                               for s, c in zip(SPLITS, splits, strict=True)}})
    return (*splits, tokenizer)


def _decode(blob) -> tuple[MLMCorpus, MLMCorpus, MLMCorpus, Tokenizer]:
    splits = [MLMCorpus(blob[s]["ids"], blob[s]["source"], tuple(blob[s]["modules"]))
              for s in SPLITS]
    return (*splits, Tokenizer(tuple(blob["vocab"])))


def _build(root: Path, seq_len: int, vocab_size: int, min_tokens: int):
    by_split: dict[str, list[tuple[str, str]]] = {s: [] for s in SPLITS}
    with preparing_progress() as progress:
        for module, source in corpus_sources(root, progress):
            by_split[split_of(module)].append((module, source))
        if not by_split["train"]:
            kept = sum(len(v) for v in by_split.values())
            raise ConfigError(f"no usable .py file under {str(root)!r} falls in the training "
                              f"split ({kept} kept in all); point root at a larger source "
                              "tree.")
        tokenizer = build_mlm_tokenizer((text for _, text in by_split["train"]), vocab_size)
        splits = [encode_corpus(by_split[s], tokenizer, seq_len, min_tokens, progress,
                                f"stdlib corpus: encoding {s}") for s in SPLITS]
    log.info("stdlib corpus: %s sequences of %d tokens; vocabulary %d",
             "/".join(str(len(c)) for c in splits), seq_len, len(tokenizer.vocab))
    return splits, tokenizer


# -- BERT masking -------------------------------------------------------------------------------
def example_seed(seed: int, index: int, epoch: int) -> int:
    """A 63-bit generator seed for one (seed, example, epoch), the same on every machine."""
    digest = hashlib.blake2b(f"{seed}:{index}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class BertMasking:
    """BERT's masking: each maskable token is chosen with probability ``prob``; a chosen token
    becomes ``[MASK]`` (share ``mask_share``), a random word (``random_share``) or stays.

    Maskable: ids ``>= first_word`` (never [PAD] [UNK] [CLS] [SEP] [MASK]). A row with maskable
    tokens but none chosen gets its token of smallest draw chosen, so every row predicts at
    least one token. Labels hold the original id where chosen, ``-100`` elsewhere.
    """

    vocab_size: int
    prob: float = 0.15
    mask_share: float = 0.8
    random_share: float = 0.1
    mask_id: int = MASK
    first_word: int = FIRST_WORD

    def __post_init__(self) -> None:
        if not 0 < self.prob <= 1:
            raise ConfigError(f"prob={self.prob}; the masking probability lies in (0, 1].")
        if (self.mask_share < 0 or self.random_share < 0
                or self.mask_share + self.random_share > 1):
            raise ConfigError(f"mask_share={self.mask_share}, random_share={self.random_share}: "
                              "both must be >= 0 with a sum <= 1 (BERT: 0.8 and 0.1).")
        if self.vocab_size <= self.first_word:
            raise ConfigError(f"vocab_size={self.vocab_size} leaves no word to draw above "
                              f"first_word={self.first_word}.")

    def __call__(self, ids: Tensor, indices: Tensor, epochs: Tensor | int = 0, seed: int = 0
                 ) -> tuple[Tensor, Tensor]:
        """(inputs, labels), both like ``ids`` (b, s); row k is masked by the generator of
        (``seed``, ``indices[k]``, ``epochs[k]``) alone."""
        if ids.dim() != 2:
            raise ConfigError(f"ids has shape {tuple(ids.shape)}; expected (batch, seq_len).")
        b, s = ids.shape
        indices = torch.as_tensor(indices).reshape(-1)
        epochs = torch.as_tensor(epochs).reshape(-1)
        if indices.numel() != b:
            raise ConfigError(f"{indices.numel()} example indices for a batch of {b} rows; "
                              "pass one index per row.")
        if epochs.numel() not in (1, b):
            raise ConfigError(f"{epochs.numel()} epochs for a batch of {b} rows; pass one "
                              "epoch, or one per row.")
        epochs = epochs.expand(b) if epochs.numel() == 1 else epochs
        u = torch.empty(b, s, dtype=torch.float64)  # choose when u < prob
        v = torch.empty(b, s, dtype=torch.float64)  # then [MASK] / random / keep by v
        words = torch.empty(b, s, dtype=torch.long)  # the random replacements
        for k in range(b):
            g = torch.Generator().manual_seed(
                example_seed(seed, int(indices[k]), int(epochs[k])))
            u[k] = torch.rand(s, generator=g, dtype=torch.float64)
            v[k] = torch.rand(s, generator=g, dtype=torch.float64)
            words[k] = torch.randint(self.first_word, self.vocab_size, (s,), generator=g)
        cpu = ids.detach().cpu()
        maskable = cpu >= self.first_word  # (b, s)
        chosen = maskable & (u < self.prob)
        empty = maskable.any(1) & ~chosen.any(1)  # (b,): rows that would predict nothing
        if bool(empty.any()):
            first = torch.where(maskable, u, torch.inf).argmin(1)  # (b,)
            chosen[empty, first[empty]] = True
        to_mask = chosen & (v < self.mask_share)
        to_random = chosen & (v >= self.mask_share) & (v < self.mask_share + self.random_share)
        inputs = torch.where(to_mask, self.mask_id, cpu)
        inputs = torch.where(to_random, words, inputs)
        labels = torch.where(chosen, cpu, IGNORE_INDEX)
        return inputs.to(ids.device), labels.to(ids.device)


def load_corpus_splits(seq_len: int, vocab_size: int, root: Path | str | None = None,
                       use_cache: bool = True
                       ) -> tuple[MLMCorpus, dict[str, MLMCorpus], Tokenizer]:
    """(train, {"val", "test"}, tokenizer) of :func:`load_stdlib_corpus`, refusing an empty
    split with a :class:`ConfigError` naming it (what the language-model tasks train on)."""
    train, val, test, tokenizer = load_stdlib_corpus(seq_len, vocab_size, root=root,
                                                     use_cache=use_cache)
    splits = {"val": val, "test": test}
    for split, data in (("train", train), *splits.items()):
        if len(data) == 0:
            raise ConfigError(f"the {split} split of the corpus is empty; use a larger "
                              "source tree or a shorter seq_len.")
    return train, splits, tokenizer
