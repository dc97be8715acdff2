"""Criteo click data: a synthetic generator at the Kaggle table sizes, and the real TSV reader.

One example is a click label, 13 integer features and 26 categorical features. Both sources give
the same tensors: dense features as ``log(1 + max(x, 0))`` (missing -> 0, as the reference DLRM
preprocesses them), one id per table in ``[0, cardinality)``, and a 0/1 label.

:class:`SyntheticCriteo` is a deterministic stand-in for the real data, built to exercise what
matters for embedding compression:

* ids follow a Zipf law per table (rank k has probability proportional to k^-s, over the whole
  table), mapped to ids by a random bijection of the table, so a few ids are frequent and most
  are rare, as in Criteo;
* integer features are log-normal counts, some missing;
* the label is planted: every id of every table has a hidden random vector (a hash of the
  table and the id, so no table of hidden vectors is stored), and the click logit is a weighted
  sum of the standardised dense features, one projection of each hidden vector, and the sum of
  the dot products of every pair of hidden vectors (what a DLRM interaction represents), with a
  bias set for ~25% positives. ``label_features`` returns those terms, so the Bayes-optimal model is
  a logistic regression on them.

Rows come in chunks of 8,192 with their own seeds, per stream ("train", "val", "test"): a split's
first rows do not depend on its length, and changing the training size leaves val and test alone.

:func:`read_criteo_tsv` reads the Kaggle files (``label \\t I1..I13 \\t C1..C26``, empty fields
allowed) and hashes each hex categorical value into its table (``1 + value mod (rows - 1)``;
id 0 is "missing"). Both loaders cache their tensors under :func:`cache_dir`, keyed by every
parameter, and show a progress bar on a terminal while they work (``COMERA_NO_PROGRESS=1``
turns it off).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from comera.data.progress import progress_bar, progress_enabled
from comera.data.stdlib_pairs import cache_dir
from comera.errors import ConfigError, DataFormatError

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

_CHUNK = 8192  # rows per seeded chunk of the generator: part of its definition, keep fixed
_CALIBRATION_CHUNKS = 8  # the intercept is fitted on this many chunks of their own stream
_ZIPF_HEAD = 1024  # Zipf ranks below this are sampled from the exact CDF, the rest by the
#                    continuous inverse CDF (relative error of a rank's mass < 1e-7 there)
_MASK = 2**31 - 1  # the id hash works on 31-bit words: products of two fit in int64
_HASH_ROUNDS = 3
_BLOCK = 8192  # rows per block of the hidden-vector hash


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
def _cache_path(kind: str, key: dict) -> Path:
    digest = hashlib.sha256(repr(sorted(key.items())).encode()).hexdigest()[:20]
    log.debug("criteo cache key %s: %s -> %s", kind, key, digest)
    return cache_dir() / f"criteo-{kind}-v{VERSION}-{digest}.pt"


def _load_cached(path: Path) -> CriteoData | None:
    if not path.is_file():
        return None
    try:
        blob = torch.load(path, weights_only=True)
        data = CriteoData(*(CriteoSplit(**blob[s]) for s in SPLITS),
                          tuple(int(c) for c in blob["cardinalities"]))
    except Exception as exc:  # a corrupt cache entry is rebuilt, not trusted
        log.warning("rebuilding corrupt data cache %s (%s)", path, exc)
        return None
    log.debug("criteo data cache hit %s", path)
    return data


def _save_cached(path: Path, data: CriteoData) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    blob = {s: {"dense": d.dense, "sparse": d.sparse, "labels": d.labels}
            for s, d in zip(SPLITS, (data.train, data.val, data.test), strict=True)}
    torch.save({**blob, "cardinalities": list(data.cardinalities)}, tmp)
    os.replace(tmp, path)


def _check_cardinalities(cardinalities: Sequence[int]) -> tuple[int, ...]:
    cards = tuple(cardinalities)
    if not cards:
        raise ConfigError("cardinalities is empty; give the rows of every categorical table.")
    for c in cards:
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c < 2**31:
            raise ConfigError(f"cardinalities {cards} holds {c!r}; every table has an int "
                              f"number of rows in [1, 2**31).")
    return cards


def _check_count(name: str, value: int, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r}; it must be an int >= {minimum}.")
    return value


# -- the synthetic generator --------------------------------------------------------------------
def _seed_of(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


def zipf_ranks(u: Tensor, size: int, exponent: float) -> Tensor:
    """Zipf ranks in ``[0, size)`` (P(k) proportional to (k + 1)^-exponent) from uniforms ``u``.

    Inverse CDF: exact over the first 1,024 ranks, the continuous (midpoint) integral beyond;
    memory stays O(1,024) for tables of any size.
    """
    head = min(size, _ZIPF_HEAD)
    s = float(exponent)
    k = torch.arange(1, head + 1, dtype=torch.float64)  # (head,)
    head_cdf = torch.cumsum(k.pow(-s), 0)  # (head,)
    head_mass = float(head_cdf[-1])
    a, b = head + 0.5, size + 0.5

    def integral(lo: float, hi: float) -> float:
        return math.log(hi / lo) if s == 1.0 else (hi ** (1 - s) - lo ** (1 - s)) / (1 - s)

    tail_mass = integral(a, b) if size > head else 0.0
    x = u.to(torch.float64) * (head_mass + tail_mass)  # (n,)
    ranks = torch.searchsorted(head_cdf, x, right=True).clamp_(max=head - 1)  # (n,)
    tail = x >= head_mass
    if size > head and bool(tail.any()):
        y = x[tail] - head_mass
        t = a * torch.exp(y) if s == 1.0 else (a ** (1 - s) + (1 - s) * y) ** (1 / (1 - s))
        ranks[tail] = torch.floor(t + 0.5).long().clamp_(head + 1, size) - 1
    return ranks


@dataclass(frozen=True)
class _World:
    """The hidden ground truth a seed fixes: feature laws, id maps, hash keys, label weights."""

    dense_mu: Tensor  # (J,) log-scale location of each count feature
    dense_sigma: Tensor  # (J,) log-scale spread
    dense_missing: Tensor  # (J,) probability that a feature is missing
    dense_weight: Tensor  # (J,) label weight of each standardised feature
    id_mult: Tensor  # (T,) rank -> id bijection: id = (mult * rank + shift) mod rows
    id_shift: Tensor  # (T,)
    salt: Tensor  # (T, h) int64 31-bit hash keys of the hidden vectors
    mix_a: Tensor  # (R, T, h) int64, odd
    mix_b: Tensor  # (R, T, h) int64
    id_direction: Tensor  # (T, h) the first-order projection of each table's hidden vectors


@dataclass(frozen=True)
class SyntheticCriteo:
    """A seeded Criteo-like click generator (see the module docstring for the model)."""

    cardinalities: tuple[int, ...] = CRITEO_KAGGLE_CARDINALITIES
    num_dense: int = CRITEO_NUM_DENSE
    zipf_exponent: float = 1.05
    hidden_dim: int = 4
    positive_rate: float = 0.25
    dense_signal: float = 1.0  # std of the dense-feature part of the logit
    id_signal: float = 1.5  # std of the first-order (one id at a time) part
    pair_signal: float = 1.0  # std of the pairwise-product part
    seed: int = 0
    _world: _World = field(init=False, repr=False, compare=False)
    _bias: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        cards = _check_cardinalities(self.cardinalities)
        object.__setattr__(self, "cardinalities", cards)
        _check_count("num_dense", self.num_dense, 0)
        _check_count("hidden_dim", self.hidden_dim, 1)
        _check_count("seed", self.seed, 0)
        if not isinstance(self.zipf_exponent, int | float) or not self.zipf_exponent > 0:
            raise ConfigError(f"zipf_exponent={self.zipf_exponent!r}; it must be > 0 "
                              "(about 1 for click logs).")
        if not isinstance(self.positive_rate, int | float) or not 0 < self.positive_rate < 1:
            raise ConfigError(f"positive_rate={self.positive_rate!r}; it must lie in (0, 1).")
        for name in ("dense_signal", "id_signal", "pair_signal"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value >= 0:
                raise ConfigError(f"{name}={value!r}; a signal strength is a number >= 0.")
        object.__setattr__(self, "_world", self._make_world())
        object.__setattr__(self, "_bias", self._calibrate_bias())

    def _make_world(self) -> _World:
        g = torch.Generator().manual_seed(_seed_of("criteo-world", self.seed))
        j, t, h = self.num_dense, len(self.cardinalities), self.hidden_dim
        mult = []
        for rows in self.cardinalities:
            m = int(torch.randint(1, max(rows, 2), (), generator=g))
            while math.gcd(m, rows) != 1:
                m += 1
            mult.append(m)

        def words(*shape: int) -> Tensor:
            return torch.randint(0, _MASK + 1, shape, generator=g, dtype=torch.int64)

        return _World(
            dense_mu=torch.empty(j, dtype=torch.float64).uniform_(0.5, 4.0, generator=g),
            dense_sigma=torch.empty(j, dtype=torch.float64).uniform_(0.5, 1.5, generator=g),
            dense_missing=torch.empty(j, dtype=torch.float64).uniform_(0.0, 0.45, generator=g),
            dense_weight=torch.randn(j, dtype=torch.float64, generator=g),
            id_mult=torch.tensor(mult, dtype=torch.int64),
            id_shift=torch.tensor([int(torch.randint(0, rows, (), generator=g))
                                   for rows in self.cardinalities], dtype=torch.int64),
            salt=words(t, h),
            mix_a=words(_HASH_ROUNDS, t, h) | 1,
            mix_b=words(_HASH_ROUNDS, t, h),
            id_direction=torch.randn(t, h, dtype=torch.float64, generator=g) / math.sqrt(h),
        )

    # -- the hidden label model -----------------------------------------------------------------
    def hidden_vectors(self, sparse: Tensor) -> Tensor:
        """The hidden vector of every id: (N, T) ids -> (N, T, h) float64, a hash of (table, id)
        mapped to U(-sqrt 3, sqrt 3) (mean 0, variance 1) per entry; nothing is stored."""
        w = self._world
        x = (sparse.to(torch.int64).unsqueeze(-1) ^ w.salt) & _MASK  # (N, T, h)
        for r in range(_HASH_ROUNDS):  # xor-shift, times an odd key, plus a key: mod 2^31
            x ^= x >> 16  # (N, T, h)
            x *= w.mix_a[r]  # (N, T, h), below 2^62
            x += w.mix_b[r]
            x &= _MASK
        u = x.to(torch.float64)  # (N, T, h) in [0, 2^31)
        return u.mul_(2 * math.sqrt(3) / (_MASK + 1)).sub_(math.sqrt(3))  # (N, T, h)

    def label_features(self, dense: Tensor, sparse: Tensor) -> Tensor:
        """The terms of the click logit: (N, J + T + 1) float64 = standardised dense features,
        one projection of each table's hidden vector, and the sum of all pairwise dot products
        of the hidden vectors."""
        w = self._world
        if dense.shape[1:] != (self.num_dense,) or sparse.shape[1:] != (len(self.cardinalities),):
            raise ConfigError(f"label_features takes dense (N, {self.num_dense}) and sparse "
                              f"(N, {len(self.cardinalities)}), got {tuple(dense.shape)} and "
                              f"{tuple(sparse.shape)}.")
        d = dense.to(torch.float64)  # (N, J)
        d = torch.where(d > 0, (d - w.dense_mu) / w.dense_sigma, torch.zeros_like(d))  # (N, J)
        first, pairs = [], []
        for start in range(0, sparse.shape[0], _BLOCK):  # blocks keep the temporaries in cache
            v = self.hidden_vectors(sparse[start:start + _BLOCK])  # (n, T, h)
            first.append((v * w.id_direction).sum(-1))  # (n, T)
            total = v.sum(1)  # (n, h)
            pairs.append(0.5 * ((total * total).sum(-1) - (v * v).sum((1, 2))))  # (n,)
        if not first:
            return torch.zeros(0, self.coefficients().numel(), dtype=torch.float64)
        return torch.cat([d, torch.cat(first), torch.cat(pairs).unsqueeze(1)], dim=1)  # (N, F)

    def coefficients(self) -> Tensor:
        """Weights of :meth:`label_features` in the logit: (J + T + 1,) float64."""
        j, t, h = self.num_dense, len(self.cardinalities), self.hidden_dim
        n_pairs = max(t * (t - 1) // 2, 1)
        dense = self.dense_signal * self._world.dense_weight / math.sqrt(max(j, 1))  # (J,)
        first = torch.full((t,), self.id_signal / math.sqrt(t), dtype=torch.float64)  # (T,)
        pair = torch.tensor([self.pair_signal / math.sqrt(n_pairs * h)], dtype=torch.float64)
        return torch.cat([dense, first, pair])  # (J + T + 1,)

    @property
    def bias(self) -> float:
        """The logit's intercept, set so that ``positive_rate`` of the clicks are positive."""
        return self._bias

    def logits(self, dense: Tensor, sparse: Tensor, bias: float | None = None) -> Tensor:
        """The true click logit of each example: (N,) float64."""
        b = self._bias if bias is None else bias
        return self.label_features(dense, sparse) @ self.coefficients() + b  # (N,)

    def _calibrate_bias(self) -> float:
        z = torch.cat([self.logits(*self._chunk("calibration", k, labels=False)[:2], bias=0.0)
                       for k in range(_CALIBRATION_CHUNKS)])  # (8 * CHUNK,)
        lo, hi = -30.0, 30.0
        for _ in range(60):  # mean sigmoid(z + b) is increasing in b
            mid = 0.5 * (lo + hi)
            if float(torch.sigmoid(z + mid).mean()) < self.positive_rate:
                lo = mid
            else:
                hi = mid
        return 0.5 * (lo + hi)

    # -- sampling -------------------------------------------------------------------------------
    def _chunk(self, stream: str, index: int, labels: bool = True
               ) -> tuple[Tensor, Tensor, Tensor | None]:
        w = self._world
        g = torch.Generator().manual_seed(_seed_of("criteo", self.seed, stream, index))
        n, j = _CHUNK, self.num_dense
        z = torch.randn(n, j, dtype=torch.float64, generator=g)  # (n, J)
        missing = torch.rand(n, j, dtype=torch.float64, generator=g) < w.dense_missing  # (n, J)
        counts = torch.floor(torch.exp(w.dense_mu + w.dense_sigma * z))  # (n, J)
        counts = counts.masked_fill(missing, 0.0)  # (n, J)
        dense = torch.log1p(counts).to(torch.float32)  # (n, J)
        u = torch.rand(n, len(self.cardinalities), dtype=torch.float64, generator=g)  # (n, T)
        columns = []
        for k, rows in enumerate(self.cardinalities):
            ranks = zipf_ranks(u[:, k], rows, self.zipf_exponent)  # (n,)
            columns.append((ranks * w.id_mult[k] + w.id_shift[k]) % rows)  # (n,)
        sparse = torch.stack(columns, dim=1).to(torch.int32)  # (n, T)
        if not labels:
            return dense, sparse, None
        p = torch.sigmoid(self.logits(dense, sparse))  # (n,)
        y = (torch.rand(n, dtype=torch.float64, generator=g) < p).to(torch.float32)  # (n,)
        return dense, sparse, y

    def generate(self, n: int, stream: str = "train",
                 advance: Callable[[float], None] | None = None) -> CriteoSplit:
        """The first ``n`` examples of ``stream`` (deterministic in seed, stream and row)."""
        _check_count("n", n, 0)
        parts = []
        for index in range(math.ceil(n / _CHUNK)):
            parts.append(self._chunk(stream, index))
            if advance is not None:
                advance(min(_CHUNK, n - index * _CHUNK))
        if not parts:
            return CriteoSplit(torch.zeros(0, self.num_dense),
                               torch.zeros(0, len(self.cardinalities), dtype=torch.int32),
                               torch.zeros(0))
        dense, sparse, labels = (torch.cat(list(col))[:n] for col in zip(*parts, strict=True))
        return CriteoSplit(dense.contiguous(), sparse.contiguous(), labels.contiguous())


def load_synthetic_criteo(generator: SyntheticCriteo | None = None, n_train: int = 1_000_000,
                          n_val: int = 100_000, n_test: int = 100_000,
                          use_cache: bool = True) -> CriteoData:
    """Train / val / test from ``generator`` (default: the Kaggle tables), cached on disk."""
    gen = generator or SyntheticCriteo()
    sizes = {"train": _check_count("n_train", n_train, 1), "val": _check_count("n_val", n_val),
             "test": _check_count("n_test", n_test)}
    key = {"generator": repr(gen), "sizes": tuple(sizes.values())}
    path = _cache_path("synthetic", key)
    if use_cache and (cached := _load_cached(path)) is not None:
        return cached
    log.info("generating synthetic Criteo (%s examples, cache %s)", sizes, path)
    with progress_bar("generating synthetic Criteo", sum(sizes.values())) as advance:
        splits = [gen.generate(n, stream, advance) for stream, n in sizes.items()]
    data = CriteoData(*splits, gen.cardinalities)
    if use_cache:
        _save_cached(path, data)
    return data


# -- the Criteo TSV reader ----------------------------------------------------------------------
def _malformed(path: Path, lineno: int, what: str) -> DataFormatError:
    return DataFormatError(f"{path}:{lineno}: {what}; a Criteo line is a 0/1 label, 13 integer "
                           "and 26 hex categorical fields, tab-separated (fields may be empty).")


def read_criteo_tsv(path: str | os.PathLike, cardinalities: Sequence[int] =
                    CRITEO_KAGGLE_CARDINALITIES, num_dense: int = CRITEO_NUM_DENSE,
                    limit: int | None = None) -> CriteoSplit:
    """Every example of a Criteo-format file (the first ``limit`` if given), in file order.

    Integer features: empty -> 0, negative -> 0, then ``log(1 + x)``. Categorical hex values
    hash to ``1 + value mod (rows - 1)`` of their table; empty -> id 0 (and a 1-row table maps
    everything to 0).
    """
    path = Path(path)
    cards = _check_cardinalities(cardinalities)
    _check_count("num_dense", num_dense, 0)
    if limit is not None:
        _check_count("limit", limit, 1)
    if not path.is_file():
        raise ConfigError(f"no Criteo file at {path}; give the path of train.txt (Kaggle) or a "
                          "file in the same format.")
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
    cards = _check_cardinalities(cardinalities)
    fr = tuple(float(x) for x in fractions)
    if len(fr) != 3 or any(x < 0 for x in fr) or abs(sum(fr) - 1.0) > 1e-9 or fr[0] == 0:
        raise ConfigError(f"fractions={fractions}; give (train, val, test) shares >= 0 that sum "
                          "to 1 with a nonzero train share, e.g. (0.8, 0.1, 0.1).")
    if not path.is_file():
        raise ConfigError(f"no Criteo file at {path}; give the path of train.txt (Kaggle) or a "
                          "file in the same format.")
    stat = path.stat()
    key = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
           "cardinalities": cards, "fractions": fr, "limit": limit}
    cache = _cache_path("tsv", key)
    if use_cache and (cached := _load_cached(cache)) is not None:
        return cached
    log.info("reading %s (cache %s)", path, cache)
    everything = read_criteo_tsv(path, cards, limit=limit)
    n = len(everything)
    n_train, n_val = int(n * fr[0]), int(n * fr[1])
    if n_train == 0:
        raise ConfigError(f"{path} holds {n} examples: too few for a training split.")
    data = CriteoData(everything.rows(0, n_train), everything.rows(n_train, n_train + n_val),
                      everything.rows(n_train + n_val, n), cards)
    if use_cache:
        _save_cached(path=cache, data=data)
    return data


def describe_data(data: CriteoData) -> dict:
    """Sizes and click rates of the splits, for results files."""
    out = {s: len(data.split(s)) for s in SPLITS}
    out.update({f"{s}_positive_rate": round(data.split(s).positive_rate(), 4) for s in SPLITS})
    out["tables"] = len(data.cardinalities)
    out["table_rows"] = sum(data.cardinalities)
    return out


__all__ = [
    "CRITEO_KAGGLE_CARDINALITIES",
    "CRITEO_NUM_DENSE",
    "CriteoData",
    "CriteoSplit",
    "DataFormatError",
    "SyntheticCriteo",
    "describe_data",
    "load_criteo_tsv",
    "load_synthetic_criteo",
    "progress_enabled",
    "read_criteo_tsv",
    "zipf_ranks",
]
