"""Criteo data: the synthetic generator (determinism, Zipf skew, a learnable planted label) and
the TSV reader (parsing against hand-computed values, malformed lines, splits, the cache)."""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

from comera.data.criteo import (
    CriteoSplit,
    DataFormatError,
    SyntheticCriteo,
    load_criteo_tsv,
    load_synthetic_criteo,
    progress_enabled,
    read_criteo_tsv,
    zipf_ranks,
)
from comera.errors import ConfigError
from comera.experiments.dlrm_task import binary_auc

SMALL = (50, 7, 3000, 20000)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COMERA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("COMERA_NO_PROGRESS", "1")


def _same(a: CriteoSplit, b: CriteoSplit) -> bool:
    return (torch.equal(a.dense, b.dense) and torch.equal(a.sparse, b.sparse)
            and torch.equal(a.labels, b.labels))


# -- the generator ------------------------------------------------------------------------------
def test_generator_is_deterministic_and_prefix_stable():
    gen = SyntheticCriteo(cardinalities=SMALL, seed=3)
    first = gen.generate(10_000)
    assert _same(first, SyntheticCriteo(cardinalities=SMALL, seed=3).generate(10_000))
    assert _same(gen.generate(100), first.rows(0, 100))  # a split's head ignores its length
    assert not torch.equal(gen.generate(100, "val").sparse, first.sparse[:100])
    other = SyntheticCriteo(cardinalities=SMALL, seed=4).generate(100)
    assert not torch.equal(other.sparse, first.sparse[:100])


@pytest.mark.parametrize("n", [100, 8192 + 5])
def test_generate_returns_exactly_n_rows_owning_their_storage(n):
    split = SyntheticCriteo(cardinalities=SMALL).generate(n)
    for tensor, width in ((split.dense, 13), (split.sparse, len(SMALL)), (split.labels, 1)):
        assert tensor.shape[0] == n and tensor.is_contiguous()
        # not a view of a whole 8,192-row chunk: the storage holds the n rows and no more
        assert tensor.untyped_storage().nbytes() == n * width * tensor.element_size()


def test_generated_examples_are_well_formed():
    gen = SyntheticCriteo(cardinalities=SMALL)
    data = gen.generate(20_000)
    assert data.dense.shape == (20_000, 13) and data.dense.dtype == torch.float32
    assert data.sparse.shape == (20_000, 4) and data.sparse.dtype == torch.int32
    assert bool((data.dense >= 0).all())
    assert ((data.dense == 0).float().mean(0) > 0.01).any()  # some features go missing
    for k, rows in enumerate(SMALL):
        column = data.sparse[:, k]
        assert int(column.min()) >= 0 and int(column.max()) < rows
    assert len(torch.unique(data.sparse[:, 1])) == 7  # a tiny table is fully used
    assert data.positive_rate() == pytest.approx(0.25, abs=0.015)


def _zipf_pmf(size: int, s: float) -> torch.Tensor:
    w = torch.arange(1, size + 1, dtype=torch.float64).pow(-s)
    return w / w.sum()


@pytest.mark.parametrize(("size", "s"), [(500, 1.05), (20_000, 1.05), (20_000, 1.0),
                                         (50_000, 0.8)])
def test_zipf_ranks_follow_the_exact_law(size, s):
    u = torch.rand(400_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ranks = zipf_ranks(u, size, s)
    assert int(ranks.min()) >= 0 and int(ranks.max()) < size
    freq = torch.bincount(ranks, minlength=size).double() / u.numel()
    pmf = _zipf_pmf(size, s)
    # bins of ranks (head exact, tail by the integral), each within 4 standard errors
    edges = [0, 1, 2, 10, 100, 1000, 1024, 2000, 5000, size]
    for lo, hi in itertools.pairwise(edges):
        if lo >= size:
            break
        hi = min(hi, size)
        p = float(pmf[lo:hi].sum())
        se = math.sqrt(p * (1 - p) / u.numel())
        assert abs(float(freq[lo:hi].sum()) - p) < 4 * se + 1e-12, (lo, hi)


def test_ids_are_skewed_like_click_logs():
    gen = SyntheticCriteo(cardinalities=SMALL, zipf_exponent=1.05)
    ids = gen.generate(100_000).sparse[:, 3].long()  # the 20,000-row table
    counts = torch.bincount(ids, minlength=20_000).sort(descending=True).values
    top = float(counts[:200].sum()) / ids.numel()  # the most frequent 1% of the ids
    expect = float(_zipf_pmf(20_000, 1.05)[:200].sum())
    assert top == pytest.approx(expect, abs=0.01)
    assert top > 0.5
    assert float((counts == 0).float().mean()) > 0.2  # and a long tail, much of it unseen


def test_planted_label_is_learnable_from_the_hidden_features():
    gen = SyntheticCriteo(cardinalities=SMALL, seed=1)
    train, test = gen.generate(20_000), gen.generate(8_000, "test")
    x_train = gen.label_features(train.dense, train.sparse)  # (N, F)
    x_test = gen.label_features(test.dense, test.sparse)
    assert x_train.shape == (20_000, 13 + 4 + 1)
    # the stated model, term by term: dense part, one projection per table, all pair products
    v = gen.hidden_vectors(train.sparse[:5])  # (5, T, h)
    pairs = sum(v[:, i] @ v[:, j].T for i in range(4) for j in range(i + 1, 4)).diagonal()
    torch.testing.assert_close(x_train[:5, -1], pairs, rtol=1e-12, atol=1e-12)
    assert v.abs().max() <= math.sqrt(3)
    # logistic regression on the hidden features (a fit, independent of the generator's weights)
    w = torch.zeros(x_train.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    design = torch.cat([x_train, torch.ones(len(train), 1, dtype=torch.float64)], 1)
    opt = torch.optim.LBFGS([w], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            design @ w, train.labels.double())
        loss.backward()
        return loss

    opt.step(closure)
    fitted = torch.cat([x_test, torch.ones(len(test), 1, dtype=torch.float64)], 1) @ w.detach()
    fitted_auc = binary_auc(fitted, test.labels)
    bayes_auc = binary_auc(gen.logits(test.dense, test.sparse), test.labels)
    assert fitted_auc > 0.75
    assert fitted_auc == pytest.approx(bayes_auc, abs=0.01)
    # the fit recovers the planted weights, and the intercept that gives ~25% positives
    coef = gen.coefficients()
    assert torch.nn.functional.cosine_similarity(w.detach()[:-1], coef, dim=0) > 0.97
    assert float(w.detach()[-1]) == pytest.approx(gen.bias, abs=0.15)
    # and the dense features alone are not enough: the ids carry most of the signal
    dense_only = binary_auc(x_test[:, :13] @ coef[:13], test.labels)
    assert dense_only < fitted_auc - 0.1


def test_generator_refuses_bad_settings():
    with pytest.raises(ConfigError, match="cardinalities"):
        SyntheticCriteo(cardinalities=(10, 0))
    with pytest.raises(ConfigError, match="cardinalities is empty"):
        SyntheticCriteo(cardinalities=())
    with pytest.raises(ConfigError, match="positive_rate"):
        SyntheticCriteo(cardinalities=SMALL, positive_rate=1.5)
    with pytest.raises(ConfigError, match="zipf_exponent"):
        SyntheticCriteo(cardinalities=SMALL, zipf_exponent=0)
    with pytest.raises(ConfigError, match="n=-1"):
        SyntheticCriteo(cardinalities=SMALL).generate(-1)


def test_synthetic_splits_are_cached_and_corrupt_entries_rebuilt(tmp_path, caplog):
    gen = SyntheticCriteo(cardinalities=SMALL)
    data = load_synthetic_criteo(gen, n_train=3000, n_val=1000, n_test=500)
    assert (len(data.train), len(data.val), len(data.test)) == (3000, 1000, 500)
    assert data.cardinalities == SMALL
    assert _same(data.val, gen.generate(1000, "val"))
    files = list((tmp_path / "cache").glob("criteo-synthetic-*.pt"))
    assert len(files) == 1
    again = load_synthetic_criteo(gen, n_train=3000, n_val=1000, n_test=500)
    assert all(_same(data.split(s), again.split(s)) for s in ("train", "val", "test"))
    load_synthetic_criteo(SyntheticCriteo(cardinalities=SMALL, seed=1), 3000, 1000, 500)
    assert len(list((tmp_path / "cache").glob("criteo-synthetic-*.pt"))) == 2  # keyed by seed
    files[0].write_bytes(b"not a torch file")
    rebuilt = load_synthetic_criteo(gen, n_train=3000, n_val=1000, n_test=500)
    assert "rebuilding corrupt data cache" in caplog.text
    assert _same(rebuilt.train, data.train)


def test_progress_bar_switch(monkeypatch):
    assert not progress_enabled()  # COMERA_NO_PROGRESS=1 (fixture)
    monkeypatch.delenv("COMERA_NO_PROGRESS")
    assert progress_enabled() == os.isatty(2)


# -- the TSV reader -----------------------------------------------------------------------------
CARDS = (5, 100, 1) + (1000,) * 23

LINES = [
    # label, 13 ints (empty and negative allowed), 26 hex categoricals (empty allowed)
    ["1", "3", "", "-2", "0", "100", *[""] * 8, "68fd1e64", "", "ffffffff", *["0a"] * 23],
    ["0", *["7"] * 13, "", "80e26c9b", "1", *[""] * 23],
    ["0", *[""] * 13, *[""] * 26],
]


def _write(path, rows, newline="\n"):
    path.write_bytes("".join("\t".join(r) + newline for r in rows).encode())
    return path


def test_tsv_fields_parse_to_the_documented_values(tmp_path):
    split = read_criteo_tsv(_write(tmp_path / "day.txt", LINES), CARDS)
    assert len(split) == 3 and split.labels.tolist() == [1.0, 0.0, 0.0]
    dense0 = [3, 0, 0, 0, 100] + [0] * 8  # empty -> 0, negative -> 0
    torch.testing.assert_close(split.dense[0], torch.log1p(torch.tensor(dense0).float()))
    torch.testing.assert_close(split.dense[1], torch.full((13,), math.log(8.0)))
    assert split.dense[2].tolist() == [0.0] * 13
    # 1 + value mod (rows - 1); empty -> 0; a one-row table -> 0
    assert split.sparse[0, :3].tolist() == [1 + 0x68FD1E64 % 4, 0, 0]
    assert split.sparse[0, 3:].tolist() == [1 + 0x0A % 999] * 23
    assert split.sparse[1, :4].tolist() == [0, 1 + 0x80E26C9B % 99, 0, 0]
    assert split.sparse[2].tolist() == [0] * 26
    crlf = read_criteo_tsv(_write(tmp_path / "crlf.txt", LINES, "\r\n"), CARDS)
    assert torch.equal(crlf.sparse, split.sparse) and torch.equal(crlf.dense, split.dense)
    assert len(read_criteo_tsv(tmp_path / "day.txt", CARDS, limit=2)) == 2


@pytest.mark.parametrize(("bad", "message"), [
    (["1", "2"], r"2 fields, expected 40"),
    (["x", *LINES[1][1:]], r"label 'x' is not 0 or 1"),
    (["0", "1.5", *LINES[1][2:]], r"integer feature I1 is '1.5'"),
    ([*LINES[1][:14], "zz", *LINES[1][15:]], r"categorical feature C1 is 'zz', not hex"),
    ([], r"1 fields, expected 40"),  # an empty line
])
def test_malformed_line_is_named_with_its_file_and_number(tmp_path, bad, message):
    path = _write(tmp_path / "bad.txt", [LINES[0], LINES[1], bad, LINES[2]])
    with pytest.raises(DataFormatError, match=rf"bad\.txt:3: {message}") as err:
        read_criteo_tsv(path, CARDS)
    assert isinstance(err.value, ValueError)


def test_tsv_splits_are_contiguous_and_cached(tmp_path):
    rows = [[str(k % 2), str(k), *[""] * 12, *[format(k, "x")] * 26] for k in range(20)]
    path = _write(tmp_path / "train.txt", rows)
    data = load_criteo_tsv(path, CARDS, fractions=(0.6, 0.2, 0.2))
    assert (len(data.train), len(data.val), len(data.test)) == (12, 4, 4)
    order = torch.expm1(torch.cat([data.split(s).dense[:, 0] for s in ("train", "val",
                                                                       "test")]))
    torch.testing.assert_close(order, torch.arange(20).float())  # file order, no shuffle
    assert len(list((tmp_path / "cache").glob("criteo-tsv-*.pt"))) == 1
    assert _same(load_criteo_tsv(path, CARDS, fractions=(0.6, 0.2, 0.2)).test, data.test)
    _write(path, rows[:10])  # a changed file is a new cache entry
    assert len(load_criteo_tsv(path, CARDS, fractions=(0.6, 0.2, 0.2)).train) == 6
    with pytest.raises(ConfigError, match="fractions"):
        load_criteo_tsv(path, CARDS, fractions=(0.6, 0.6, 0.2))
    with pytest.raises(ConfigError, match="no Criteo file"):
        read_criteo_tsv(tmp_path / "missing.txt", CARDS)


def test_one_cache_step_serves_both_sources(tmp_path, caplog):
    """``cached_data``: a miss builds (logged) and saves, a hit does not build, and
    ``use_cache=False`` builds every time and writes nothing, for either source."""
    import logging

    from comera.data.criteo.splits import cached_data

    built = []
    gen = SyntheticCriteo(cardinalities=SMALL)

    def build():
        built.append(1)
        return load_synthetic_criteo(gen, 30, 10, 10, use_cache=False)

    cache = tmp_path / "cache"
    assert not cache.exists()  # the uncached load above wrote nothing yet
    with caplog.at_level(logging.INFO, logger="comera.data"):
        first = cached_data("synthetic", {"probe": 1}, build, "building the probe")
    assert "building the probe (cache " in caplog.text and len(built) == 1
    again = cached_data("synthetic", {"probe": 1}, build, "building the probe")
    assert len(built) == 1 and _same(again.train, first.train)  # a hit: not built again
    cached_data("synthetic", {"probe": 2}, build, "x", use_cache=False)
    assert len(built) == 2 and len(list(cache.glob("criteo-synthetic-*.pt"))) == 1
    rows = [[str(k % 2), str(k), *[""] * 12, *[format(k, "x")] * 26] for k in range(10)]
    path = _write(tmp_path / "train.txt", rows)
    assert len(load_criteo_tsv(path, CARDS, use_cache=False).train) == 8
    assert not list(cache.glob("criteo-tsv-*.pt"))
