"""MNLI (the paper's sentence-pair task) from local files, or through the `datasets` package.

``load_mnli(path)`` reads a folder holding one of MNLI's published layouts:

- GLUE: ``train.tsv``, ``dev_matched.tsv``, ``dev_mismatched.tsv`` (tab-separated with a header;
  columns include ``sentence1``, ``sentence2``, ``gold_label``);
- MultiNLI 1.0: ``multinli_1.0_{train,dev_matched,dev_mismatched}.txt`` (the same columns) or
  ``.jsonl`` (one object per line with ``sentence1``, ``sentence2``, ``gold_label``);
- an export of the Hugging Face dataset: ``{train,validation_matched,validation_mismatched}``
  as ``.jsonl`` or ``.tsv``, with ``premise``, ``hypothesis`` and an integer ``label``.

``load_mnli(None)`` calls ``datasets.load_dataset("glue", "mnli")`` (network, or the `datasets`
cache); nothing is downloaded at import. Labels: entailment 0, neutral 1, contradiction 2; rows
without a gold label (``-`` or ``-1``) are dropped. Splits: ``train``, ``validation_matched``,
``validation_mismatched``. Pairs are encoded ``[CLS] premise [SEP] hypothesis [SEP]`` by a word
:class:`~comera.data.tokenizer.Tokenizer` (built on the training premises and hypotheses
unless given), and the encoded splits are cached under the user cache directory.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from comera.data.cache import cache_file, read_cached, write_cached
from comera.data.progress import preparing_progress
from comera.data.stdlib_pairs import PairDataset
from comera.data.tokenizer import PAD, Tokenizer
from comera.errors import ConfigError, DataFormatError
from comera.numbers import is_int

log = logging.getLogger("comera.data")

VERSION = 1
LABELS = {"entailment": 0, "neutral": 1, "contradiction": 2}
SPLITS = ("train", "validation_matched", "validation_mismatched")
# file names searched per split, in order
FILES = {
    "train": ("train.tsv", "multinli_1.0_train.txt", "multinli_1.0_train.jsonl", "train.jsonl"),
    "validation_matched": ("dev_matched.tsv", "multinli_1.0_dev_matched.txt",
                           "multinli_1.0_dev_matched.jsonl", "validation_matched.jsonl",
                           "validation_matched.tsv"),
    "validation_mismatched": ("dev_mismatched.tsv", "multinli_1.0_dev_mismatched.txt",
                              "multinli_1.0_dev_mismatched.jsonl", "validation_mismatched.jsonl",
                              "validation_mismatched.tsv"),
}
_FIELDS = (("sentence1", "sentence2", "gold_label"), ("premise", "hypothesis", "label"))


DatasetFormatError = DataFormatError  # the name this module used before


class MNLI(NamedTuple):
    """The encoded splits and the tokenizer that encoded them."""

    train: PairDataset
    validation_matched: PairDataset
    validation_mismatched: PairDataset
    tokenizer: Tokenizer


Example = tuple[str, str, int]  # (premise, hypothesis, label)


# -- reading ------------------------------------------------------------------------------------
def label_id(value: object, where: str) -> int | None:
    """0/1/2 for a gold label given as a name or an int; None for an unlabelled row."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in LABELS:
            return LABELS[text]
        if text in ("-", "", "-1"):
            return None
        if text in ("0", "1", "2"):
            return int(text)
    elif isinstance(value, int) and not isinstance(value, bool):
        if value in (0, 1, 2):
            return value
        if value == -1:
            return None
    raise DatasetFormatError(f"{where}: gold label {value!r}; expected one of "
                             f"{', '.join(LABELS)} (or 0/1/2), '-' or -1 for none.")


def _pick_fields(names: Iterable[str], where: str) -> tuple[str, str, str]:
    names = set(names)
    for fields in _FIELDS:
        if set(fields) <= names:
            return fields
    raise DatasetFormatError(f"{where}: columns {sorted(names)} lack "
                             f"{' or '.join('/'.join(f) for f in _FIELDS)}; is this an MNLI file?")


def _example(record: dict, fields: tuple[str, str, str], where: str) -> Example | None:
    first, second, gold = fields
    label = label_id(record[gold], where)
    if label is None:
        return None
    a, b = record[first], record[second]
    if not isinstance(a, str) or not isinstance(b, str):
        raise DatasetFormatError(f"{where}: {first}/{second} must be text, got "
                                 f"{type(a).__name__}/{type(b).__name__}.")
    return a, b, label


def read_tsv(path: Path) -> Iterator[Example]:
    """Labelled examples of a GLUE / MultiNLI tab-separated file with a header row."""
    with open(path, encoding="utf-8", newline="") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(rows, None)
        if header is None:
            raise DatasetFormatError(f"{path}:1: the file is empty; expected a header row.")
        fields = _pick_fields(header, f"{path}:1")
        for line, row in enumerate(rows, start=2):
            if not row:
                continue
            if len(row) != len(header):
                raise DatasetFormatError(f"{path}:{line}: {len(row)} tab-separated fields, the "
                                         f"header has {len(header)}; the file is malformed.")
            example = _example(dict(zip(header, row, strict=True)), fields, f"{path}:{line}")
            if example is not None:
                yield example


def read_jsonl(path: Path) -> Iterator[Example]:
    """Labelled examples of a JSON-lines file (MultiNLI 1.0 or a Hugging Face export)."""
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DatasetFormatError(f"{path}:{line}: not valid JSON ({exc.msg} at column "
                                         f"{exc.colno}).") from None
            if not isinstance(record, dict):
                raise DatasetFormatError(f"{path}:{line}: expected a JSON object, got "
                                         f"{type(record).__name__}.")
            where = f"{path}:{line}"
            example = _example(record, _pick_fields(record, where), where)
            if example is not None:
                yield example


def find_files(folder: Path) -> dict[str, Path]:
    """The file of each split in ``folder`` (first match of :data:`FILES`)."""
    found, missing = {}, []
    for split in SPLITS:
        hit = next((folder / n for n in FILES[split] if (folder / n).is_file()), None)
        if hit is None:
            missing.append(f"{split} ({', '.join(FILES[split])})")
        else:
            found[split] = hit
    if missing:
        raise ConfigError(f"MNLI folder {str(folder)!r} lacks {'; '.join(missing)}. Download "
                          "MNLI (GLUE or MultiNLI 1.0) there, or pass None to use the "
                          "`datasets` package.")
    return found


def _read_file(path: Path) -> list[Example]:
    reader = read_jsonl if path.suffix == ".jsonl" else read_tsv
    return list(reader(path))


def _from_datasets() -> dict[str, list[Example]]:
    try:
        import datasets
    except ImportError:
        raise ConfigError("no MNLI folder was given and the `datasets` package is not "
                          "installed: pip install datasets (it downloads GLUE/MNLI, so it "
                          "needs the network once), or pass a folder holding the MNLI "
                          "files.") from None
    try:
        loaded = datasets.load_dataset("glue", "mnli")
    except Exception as exc:  # no network, hub errors: say what to do instead
        raise ConfigError(f"datasets.load_dataset('glue', 'mnli') failed ({exc}); without "
                          "network access, download MNLI elsewhere and pass its folder.") from exc
    out = {}
    for split in SPLITS:
        if split not in loaded:
            raise DatasetFormatError(f"datasets' glue/mnli has splits {sorted(loaded)}, "
                                     f"without {split!r}.")
        fields = ("premise", "hypothesis", "label")
        out[split] = [ex for k, record in enumerate(loaded[split])
                      if (ex := _example(record, fields, f"glue/mnli {split} row {k}")) is not None]
    return out


# -- encoding and caching ------------------------------------------------------------------------
def encode_pairs(examples: list[Example], tokenizer: Tokenizer, max_len: int,
                 progress=None, description: str = "encoding") -> PairDataset:
    """``[CLS] premise [SEP] hypothesis [SEP]`` ids, segments and labels, PAD-filled."""
    task = progress.add_task(description, total=len(examples)) if progress else None
    ids = torch.full((len(examples), max_len), PAD, dtype=torch.long)  # (N, max_len)
    segments = torch.zeros((len(examples), max_len), dtype=torch.long)  # (N, max_len)
    for row, (first, second, _) in enumerate(examples):
        tok, seg = tokenizer.encode_pair(first, second, max_len)
        ids[row, :len(tok)] = torch.tensor(tok)
        segments[row, :len(seg)] = torch.tensor(seg)
        if progress is not None and row % 1024 == 1023:
            progress.update(task, completed=row + 1)
    if progress is not None:
        progress.update(task, completed=len(examples))
    labels = torch.tensor([label for _, _, label in examples], dtype=torch.long)  # (N,)
    return PairDataset(ids, segments, labels)


def _source_key(files: dict[str, Path] | None) -> str:
    if files is None:
        return "datasets-glue-mnli"
    h = hashlib.sha256()
    for split in SPLITS:
        stat = files[split].stat()
        h.update(f"{files[split].resolve()}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


def _decode(blob) -> MNLI:
    return MNLI(*(PairDataset(**blob[s]) for s in SPLITS), Tokenizer(tuple(blob["vocab"])))


def load_mnli(path: Path | str | None = None, tokenizer: Tokenizer | None = None,
              max_len: int = 128, vocab_size: int = 30000, use_cache: bool = True) -> MNLI:
    """The three MNLI splits encoded for a pair classifier (see the module doc).

    ``path``: a folder with the MNLI files, or None to use ``datasets.load_dataset``.
    ``tokenizer``: the vocabulary to encode with; None builds one of ``vocab_size`` entries
    from the training split.
    """
    if not is_int(max_len, 3):
        raise ConfigError(f"max_len={max_len!r}; a pair needs [CLS] [SEP] [SEP], so >= 3.")
    files = None
    if path is not None:
        folder = Path(path)
        if not folder.is_dir():
            raise ConfigError(f"MNLI path {str(folder)!r} is not a folder; pass the folder "
                              "holding train.tsv / dev_matched.tsv / dev_mismatched.tsv (or "
                              "the MultiNLI 1.0 files), or None to use `datasets`.")
        files = find_files(folder)
    vocab_key = ("built" if tokenizer is None else
                 hashlib.sha256("\n".join(tokenizer.vocab).encode()).hexdigest()[:16])
    cached = cache_file("mnli", VERSION, {"source": _source_key(files), "max_len": max_len,
                                          "vocab_size": vocab_size, "vocab": vocab_key})
    data = read_cached(cached, _decode) if use_cache else None
    if data is not None:
        return data
    with preparing_progress() as progress:
        if files is None:
            examples = _from_datasets()
        else:
            task = progress.add_task("MNLI: reading", total=len(SPLITS))
            examples = {}
            for split in SPLITS:
                examples[split] = _read_file(files[split])
                progress.advance(task)
        if not examples["train"] and tokenizer is None:
            raise ConfigError("the MNLI training split holds no labelled pair, so no vocabulary "
                              "can be built from it; pass a tokenizer.")
        if tokenizer is None:
            tokenizer = Tokenizer.build((t for a, b, _ in examples["train"] for t in (a, b)),
                                        vocab_size)
        data = {s: encode_pairs(examples[s], tokenizer, max_len, progress, f"MNLI: encoding {s}")
                for s in SPLITS}
    log.info("MNLI: %s labelled pairs; vocabulary %d",
             "/".join(str(len(d)) for d in data.values()), len(tokenizer.vocab))
    if use_cache:
        write_cached(cached, {"vocab": list(tokenizer.vocab),
                              **{s: {"ids": d.ids, "segments": d.segments, "labels": d.labels}
                                 for s, d in data.items()}})
    return MNLI(data["train"], data["validation_matched"], data["validation_mismatched"],
                tokenizer)
