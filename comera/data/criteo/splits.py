"""Criteo click data as the model takes it: the split types, the table sizes, and their cache.

One example is a click label, 13 integer features and 26 categorical features: dense features as
``log(1 + max(x, 0))`` (missing -> 0, as the reference DLRM preprocesses them), one id per table
in ``[0, cardinality)``, and a 0/1 label. Both sources (:mod:`comera.data.criteo.synthetic`,
:mod:`comera.data.criteo.tsv`) cache their splits through :mod:`comera.data.cache`, keyed by
every parameter.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from comera.data.cache import cache_file, read_cached, write_cached
from comera.errors import ConfigError
from comera.numbers import is_int

log = logging.getLogger("comera.data")

VERSION = 1
SPLITS = ("train", "val", "test")
# Rows of the 26 categorical tables of the Criteo Display Advertising Challenge (Kaggle) data as
# preprocessed by the reference DLRM (every distinct value of the 7 days); 33,762,577 in all.
CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
CRITEO_NUM_DENSE = 13


# -- containers ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class CriteoSplit:
    """Examples of one split, as the model takes them."""

    dense: Tensor  # (N, num_dense) float32: log(1 + max(x, 0)), 0 where missing
    sparse: Tensor  # (N, T) int32: one id per table, in [0, cardinality)
    labels: Tensor  # (N,) float32 in {0, 1}

    def __post_init__(self) -> None:
        n = self.labels.shape[0]
        if self.dense.dim() != 2 or self.sparse.dim() != 2 or self.labels.dim() != 1 \
                or self.dense.shape[0] != n or self.sparse.shape[0] != n:
            raise ConfigError(f"a split needs dense (N, F), sparse (N, T) and labels (N,) with "
                              f"one N; got {tuple(self.dense.shape)}, "
                              f"{tuple(self.sparse.shape)}, {tuple(self.labels.shape)}.")

    def __len__(self) -> int:
        return self.labels.shape[0]

    def positive_rate(self) -> float:
        return float(self.labels.mean()) if len(self) else 0.0

    def rows(self, start: int, stop: int) -> CriteoSplit:
        return CriteoSplit(self.dense[start:stop], self.sparse[start:stop],
                           self.labels[start:stop])


@dataclass(frozen=True)
class CriteoData:
    """Train, val and test splits and the table sizes their ids index."""

    train: CriteoSplit
    val: CriteoSplit
    test: CriteoSplit
    cardinalities: tuple[int, ...]

    def split(self, name: str) -> CriteoSplit:
        if name not in SPLITS:
            raise ConfigError(f"unknown split {name!r}; choose one of {SPLITS}.")
        return getattr(self, name)


# -- caching --------------------------------------------------------------------------------------
def cache_path(kind: str, key: dict) -> Path:
    """The cache file of the Criteo data of ``kind`` ("synthetic", "tsv") for ``key``."""
    return cache_file(f"criteo-{kind}", VERSION, key)


def _decode(blob) -> CriteoData:
    return CriteoData(*(CriteoSplit(**blob[s]) for s in SPLITS),
                      tuple(int(c) for c in blob["cardinalities"]))


def load_cached(path: Path) -> CriteoData | None:
    """The cached splits at ``path``; None on a miss or a damaged file (rebuilt, with a warning)."""
    return read_cached(path, _decode)


def save_cached(path: Path, data: CriteoData) -> None:
    """Cache ``data`` at ``path`` (atomically; a failed write is logged)."""
    blob = {s: {"dense": d.dense, "sparse": d.sparse, "labels": d.labels}
            for s, d in zip(SPLITS, (data.train, data.val, data.test), strict=True)}
    write_cached(path, {**blob, "cardinalities": list(data.cardinalities)})


def cached_data(kind: str, key: dict, build: Callable[[], CriteoData], what: str,
                use_cache: bool = True) -> CriteoData:
    """The splits of ``kind`` ("synthetic", "tsv") cached for ``key``, else ``build()`` (logged
    as ``what``) and cached: the one cache step of both sources (``use_cache=False`` neither
    reads nor writes)."""
    path = cache_path(kind, key)
    if use_cache and (cached := load_cached(path)) is not None:
        return cached
    log.info("%s (cache %s)", what, path)
    data = build()
    if use_cache:
        save_cached(path, data)
    return data


def check_cardinalities(cardinalities: Sequence[int]) -> tuple[int, ...]:
    """``cardinalities`` as a tuple, checked: one int in [1, 2**31) per table."""
    cards = tuple(cardinalities)
    if not cards:
        raise ConfigError("cardinalities is empty; give the rows of every categorical table.")
    for c in cards:
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c < 2**31:
            raise ConfigError(f"cardinalities {cards} holds {c!r}; every table has an int "
                              f"number of rows in [1, 2**31).")
    return cards


def check_count(name: str, value: int, minimum: int = 0) -> int:
    """``value``, checked to be an int >= ``minimum`` (the error names ``name``)."""
    if not is_int(value, minimum):
        raise ConfigError(f"{name}={value!r}; it must be an int >= {minimum}.")
    return value


def describe_data(data: CriteoData) -> dict:
    """Sizes and click rates of the splits, for results files."""
    out = {s: len(data.split(s)) for s in SPLITS}
    out.update({f"{s}_positive_rate": round(data.split(s).positive_rate(), 4) for s in SPLITS})
    out["tables"] = len(data.cardinalities)
    out["table_rows"] = sum(data.cardinalities)
    return out


__all__ = ["CRITEO_KAGGLE_CARDINALITIES", "CRITEO_NUM_DENSE", "SPLITS", "CriteoData",
           "CriteoSplit", "cache_path", "cached_data", "check_cardinalities", "check_count",
           "describe_data", "load_cached", "save_cached"]
