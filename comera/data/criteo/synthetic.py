"""Synthetic Criteo click data: a seeded generator at the Kaggle table sizes.

:class:`SyntheticCriteo` is a deterministic stand-in for the real data (the tensors the TSV
reader gives, see :mod:`comera.data.criteo.splits`), built to exercise what matters for embedding
compression:

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

:func:`load_synthetic_criteo` caches the generated splits (:mod:`comera.data.cache`), keyed by
the generator and the sizes, and shows a progress bar on a terminal while it works
(``COMERA_NO_PROGRESS=1`` turns it off).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

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
from comera.errors import ConfigError

_CHUNK = 8192  # rows per seeded chunk of the generator: part of its definition, keep fixed
_CALIBRATION_CHUNKS = 8  # the intercept is fitted on this many chunks of their own stream
_ZIPF_HEAD = 1024  # Zipf ranks below this are sampled from the exact CDF, the rest by the
#                    continuous inverse CDF (relative error of a rank's mass < 1e-7 there)
_MASK = 2**31 - 1  # the id hash works on 31-bit words: products of two fit in int64
_HASH_ROUNDS = 3
_BLOCK = 8192  # rows per block of the hidden-vector hash


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
        cards = check_cardinalities(self.cardinalities)
        object.__setattr__(self, "cardinalities", cards)
        check_count("num_dense", self.num_dense, 0)
        check_count("hidden_dim", self.hidden_dim, 1)
        check_count("seed", self.seed, 0)
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
        """The first ``n`` examples of ``stream`` (deterministic in seed, stream and row), in
        tensors of exactly ``n`` rows."""
        check_count("n", n, 0)
        parts = []
        for index in range(math.ceil(n / _CHUNK)):
            rows = min(_CHUNK, n - index * _CHUNK)
            parts.append(tuple(t[:rows] for t in self._chunk(stream, index)))
            if advance is not None:
                advance(rows)
        if not parts:
            return CriteoSplit(torch.zeros(0, self.num_dense),
                               torch.zeros(0, len(self.cardinalities), dtype=torch.int32),
                               torch.zeros(0))
        # torch.cat copies, so the split owns exactly n rows (a slice would keep a whole chunk)
        dense, sparse, labels = (torch.cat(list(col)) for col in zip(*parts, strict=True))
        return CriteoSplit(dense, sparse, labels)


def load_synthetic_criteo(generator: SyntheticCriteo | None = None, n_train: int = 1_000_000,
                          n_val: int = 100_000, n_test: int = 100_000,
                          use_cache: bool = True) -> CriteoData:
    """Train / val / test from ``generator`` (default: the Kaggle tables), cached on disk."""
    gen = generator or SyntheticCriteo()
    sizes = {"train": check_count("n_train", n_train, 1), "val": check_count("n_val", n_val),
             "test": check_count("n_test", n_test)}
    key = {"generator": repr(gen), "sizes": tuple(sizes.values())}

    def build() -> CriteoData:
        with progress_bar("generating synthetic Criteo", sum(sizes.values())) as advance:
            splits = [gen.generate(n, stream, advance) for stream, n in sizes.items()]
        return CriteoData(*splits, gen.cardinalities)

    return cached_data("synthetic", key, build,
                       f"generating synthetic Criteo ({sizes} examples)", use_cache)


__all__ = ["SyntheticCriteo", "load_synthetic_criteo", "zipf_ranks"]
