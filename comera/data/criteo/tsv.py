"""The Criteo TSV reader: the Kaggle files (``label \\t I1..I13 \\t C1..C26``, empty fields
allowed) as :class:`~comera.data.criteo.splits.CriteoSplit` tensors.

Each hex categorical value hashes into its table (``1 + value mod (rows - 1)``; id 0 is
"missing"). :func:`load_criteo_tsv` splits the file into contiguous train / val / test parts and
caches them, keyed by the file's size and modification time and every parameter; a progress bar
shows on a terminal while it reads (``COMERA_NO_PROGRESS=1`` turns it off).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from comera.data.criteo.splits import (
    CRITEO_KAGGLE_CARDINALITIES,
    CRITEO_NUM_DENSE,
    CriteoData,
    CriteoSplit,
    cached_data,
    check_cardinalities,
    check_count,
)
from comera.data.progress import progress_bar
from comera.errors import ConfigError, DataFormatError

_CHUNK = 8192  # lines parsed into one block of tensors


def _malformed(path: Path, lineno: int, what: str) -> DataFormatError:
    return DataFormatError(f"{path}:{lineno}: {what}; a Criteo line is a 0/1 label, 13 integer "
                           "and 26 hex categorical fields, tab-separated (fields may be empty).")


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise ConfigError(f"no Criteo file at {path}; give the path of train.txt (Kaggle) or a "
                          "file in the same format.")


def read_criteo_tsv(path: str | os.PathLike, cardinalities: Sequence[int] =
                    CRITEO_KAGGLE_CARDINALITIES, num_dense: int = CRITEO_NUM_DENSE,
                    limit: int | None = None) -> CriteoSplit:
    """Every example of a Criteo-format file (the first ``limit`` if given), in file order.

    Integer features: empty -> 0, negative -> 0, then ``log(1 + x)``. Categorical hex values
    hash to ``1 + value mod (rows - 1)`` of their table; empty -> id 0 (and a 1-row table maps
    everything to 0).
    """
    path = Path(path)
    cards = check_cardinalities(cardinalities)
    check_count("num_dense", num_dense, 0)
    if limit is not None:
        check_count("limit", limit, 1)
    _check_file(path)
    n_fields = 1 + num_dense + len(cards)
    moduli = [max(c - 1, 1) for c in cards]
    labels: list[int] = []
    ints: list[int] = []
    cats: list[int] = []
    parts: list[CriteoSplit] = []

    def flush() -> None:  # python ints -> compact tensors, every _CHUNK lines
        n = len(labels)
        counts = torch.tensor(ints, dtype=torch.float64).reshape(n, num_dense)  # (n, J)
        parts.append(CriteoSplit(torch.log1p(counts).to(torch.float32),  # (n, J)
                                 torch.tensor(cats, dtype=torch.int32).reshape(n, len(cards)),
                                 torch.tensor(labels, dtype=torch.float32)))  # (n,)
        labels.clear()
        ints.clear()
        cats.clear()

    with path.open("rb") as f, progress_bar(f"reading {path.name}", path.stat().st_size) as advance:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and lineno > limit:
                break
            advance(len(line))
            fields = line.rstrip(b"\r\n").split(b"\t")
            if len(fields) != n_fields:
                raise _malformed(path, lineno, f"{len(fields)} fields, expected {n_fields}")
            label = fields[0]
            if label not in (b"0", b"1"):
                raise _malformed(path, lineno, f"label {label.decode(errors='replace')!r} is "
                                               "not 0 or 1")
            labels.append(label == b"1")
            for j in range(num_dense):
                raw = fields[1 + j]
                try:
                    ints.append(max(int(raw), 0) if raw else 0)
                except ValueError:
                    raise _malformed(path, lineno, f"integer feature I{j + 1} is "
                                                   f"{raw.decode(errors='replace')!r}") from None
            for t, m in enumerate(moduli):
                raw = fields[1 + num_dense + t]
                try:
                    cats.append(1 + int(raw, 16) % m if raw and cards[t] > 1 else 0)
                except ValueError:
                    raise _malformed(path, lineno, f"categorical feature C{t + 1} is "
                                     f"{raw.decode(errors='replace')!r}, not hex") from None
            if len(labels) == _CHUNK:
                flush()
    if labels or not parts:
        flush()
    return CriteoSplit(torch.cat([p.dense for p in parts]),  # (N, J)
                       torch.cat([p.sparse for p in parts]),  # (N, T)
                       torch.cat([p.labels for p in parts]))  # (N,)


def load_criteo_tsv(path: str | os.PathLike, cardinalities: Sequence[int] =
                    CRITEO_KAGGLE_CARDINALITIES, fractions: tuple[float, float, float] =
                    (0.8, 0.1, 0.1), limit: int | None = None,
                    use_cache: bool = True) -> CriteoData:
    """Train / val / test from a Criteo file: contiguous parts in file order (time order for
    the Kaggle data), sized by ``fractions``; cached on disk, keyed by the file's size and
    modification time and every parameter."""
    path = Path(path).resolve()
    cards = check_cardinalities(cardinalities)
    fr = tuple(float(x) for x in fractions)
    if len(fr) != 3 or any(x < 0 for x in fr) or abs(sum(fr) - 1.0) > 1e-9 or fr[0] == 0:
        raise ConfigError(f"fractions={fractions}; give (train, val, test) shares >= 0 that sum "
                          "to 1 with a nonzero train share, e.g. (0.8, 0.1, 0.1).")
    _check_file(path)
    stat = path.stat()
    key = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
           "cardinalities": cards, "fractions": fr, "limit": limit}

    def build() -> CriteoData:
        everything = read_criteo_tsv(path, cards, limit=limit)
        n = len(everything)
        n_train, n_val = int(n * fr[0]), int(n * fr[1])
        if n_train == 0:
            raise ConfigError(f"{path} holds {n} examples: too few for a training split.")
        return CriteoData(everything.rows(0, n_train),
                          everything.rows(n_train, n_train + n_val),
                          everything.rows(n_train + n_val, n), cards)

    return cached_data("tsv", key, build, f"reading {path}", use_cache)


__all__ = ["load_criteo_tsv", "read_criteo_tsv"]
