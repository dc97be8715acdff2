"""The MNLI loader on tiny files in MNLI's published formats, written here."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from comera.data import mnli
from comera.data.tokenizer import CLS, PAD, SEP, SPECIALS, UNK, Tokenizer
from comera.errors import ConfigError


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COMERA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("COMERA_NO_PROGRESS", "1")


GLUE_HEADER = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse",
               "sentence2_binary_parse", "sentence1_parse", "sentence2_parse", "sentence1",
               "sentence2", "label1", "gold_label"]
MULTINLI_HEADER = ["gold_label", "sentence1_binary_parse", "sentence2_binary_parse",
                   "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "promptID",
                   "pairID", "genre", "label1", "label2", "label3", "label4", "label5"]

TRAIN = [("A man sleeps.", "A person rests.", "entailment"),
         ("A dog runs.", "A cat sleeps.", "contradiction"),
         ('The "big" man runs.', "A man moves fast.", "neutral"),
         ("A dog sleeps.", "Nobody agrees.", "-")]  # no gold label: dropped
MATCHED = [("A cat runs.", "A dog rests.", "neutral"), ("A man runs.", "A man moves.", "-")]
MISMATCHED = [("Zebras graze.", "An animal eats.", "entailment")]


def _glue_row(k: int, a: str, b: str, gold: str) -> list[str]:
    return [str(k), str(k), f"{k}e", "fiction", "( x )", "( y )", "(ROOT x)", "(ROOT y)", a, b,
            gold if gold != "-" else "neutral", gold]


def _write_glue(folder, rows=None):
    folder.mkdir(parents=True, exist_ok=True)
    for name, examples in (("train.tsv", TRAIN), ("dev_matched.tsv", MATCHED),
                           ("dev_mismatched.tsv", MISMATCHED)):
        lines = ["\t".join(GLUE_HEADER)]
        lines += ["\t".join(_glue_row(k, *ex)) for k, ex in enumerate(examples)]
        (folder / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def _multinli_record(a: str, b: str, gold: str) -> dict:
    return {"annotator_labels": [gold], "genre": "fiction", "gold_label": gold, "pairID": "1e",
            "promptID": "1", "sentence1": a, "sentence1_binary_parse": "( x )",
            "sentence1_parse": "(ROOT x)", "sentence2": b, "sentence2_binary_parse": "( y )",
            "sentence2_parse": "(ROOT y)"}


def _write_multinli_jsonl(folder):
    folder.mkdir(parents=True, exist_ok=True)
    for split, examples in (("train", TRAIN), ("dev_matched", MATCHED),
                            ("dev_mismatched", MISMATCHED)):
        lines = [json.dumps(_multinli_record(*ex)) for ex in examples]
        (folder / f"multinli_1.0_{split}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


LABEL = {"entailment": 0, "neutral": 1, "contradiction": 2}


def _expected_labels(examples) -> list[int]:
    return [LABEL[g] for _, _, g in examples if g != "-"]


@pytest.mark.parametrize("writer", [_write_glue, _write_multinli_jsonl])
def test_reads_labels_and_drops_unlabelled_rows(tmp_path, writer):
    data = mnli.load_mnli(writer(tmp_path / "mnli"), max_len=16)
    assert data.train.labels.tolist() == _expected_labels(TRAIN)
    assert data.validation_matched.labels.tolist() == _expected_labels(MATCHED)
    assert data.validation_mismatched.labels.tolist() == _expected_labels(MISMATCHED)
    # the vocabulary comes from the training pairs only
    assert data.tokenizer.vocab[:4] == SPECIALS
    assert "man" in data.tokenizer.vocab and "zebras" not in data.tokenizer.vocab


def test_encodes_pairs_with_the_given_vocabulary(tmp_path):
    words = ("a", "man", "sleeps", ".", "person", "rests", "dog", "runs")
    tok = Tokenizer((*SPECIALS, *words))
    w = {x: k + len(SPECIALS) for k, x in enumerate(words)}
    data = mnli.load_mnli(_write_glue(tmp_path / "mnli"), tokenizer=tok, max_len=12)
    first = [CLS, w["a"], w["man"], w["sleeps"], w["."], SEP, w["a"], w["person"], w["rests"],
             w["."], SEP, PAD]
    assert data.train.ids[0].tolist() == first
    assert data.train.segments[0].tolist() == [0] * 6 + [1] * 5 + [0]
    # "A cat sleeps." with "cat" unknown: [UNK]; truncation keeps at most max_len ids
    assert data.train.ids[1].tolist()[6:10] == [w["a"], UNK, w["sleeps"], w["."]]
    assert data.train.ids.shape == (3, 12)
    assert data.tokenizer == tok


def test_hugging_face_export_with_integer_labels(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    for split, rows in (("train", [("A b.", "C d.", 0), ("E f.", "G h.", 2), ("I j.", "K", -1)]),
                        ("validation_matched", [("A.", "B.", 1)]),
                        ("validation_mismatched", [("C.", "D.", 2)])):
        lines = [json.dumps({"premise": a, "hypothesis": b, "label": y, "idx": k})
                 for k, (a, b, y) in enumerate(rows)]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    data = mnli.load_mnli(folder, max_len=8)
    assert data.train.labels.tolist() == [0, 2]
    assert data.validation_matched.labels.tolist() == [1]


def test_malformed_files_name_the_file_and_line(tmp_path):
    folder = _write_glue(tmp_path / "tsv")
    train = folder / "train.tsv"
    lines = train.read_text().splitlines()
    lines[2] = "\t".join(lines[2].split("\t")[:-2])  # a row missing two fields
    train.write_text("\n".join(lines) + "\n")
    with pytest.raises(mnli.DatasetFormatError, match=r"train\.tsv:3: 10 tab-separated"):
        mnli.load_mnli(folder)

    folder = _write_multinli_jsonl(tmp_path / "jsonl")
    dev = folder / "multinli_1.0_dev_matched.jsonl"
    dev.write_text(dev.read_text() + '{"sentence1": "x", \n')
    with pytest.raises(mnli.DatasetFormatError, match=r"dev_matched\.jsonl:3: not valid JSON"):
        mnli.load_mnli(folder)

    folder = _write_glue(tmp_path / "label")
    dev = folder / "dev_mismatched.tsv"
    dev.write_text(dev.read_text().replace("\tentailment\n", "\tmaybe\n"))
    with pytest.raises(mnli.DatasetFormatError, match=r"dev_mismatched\.tsv:2: gold label"):
        mnli.load_mnli(folder)

    folder = tmp_path / "columns"
    folder.mkdir()
    for name in ("train.tsv", "dev_matched.tsv", "dev_mismatched.tsv"):
        (folder / name).write_text("text\tscore\nhello\t1\n")
    with pytest.raises(mnli.DatasetFormatError, match=r"train\.tsv:1: columns"):
        mnli.load_mnli(folder)
    assert issubclass(mnli.DatasetFormatError, ValueError)


def test_missing_files_and_missing_network_are_clear_errors(tmp_path, monkeypatch):
    folder = tmp_path / "partial"
    _write_glue(folder)
    (folder / "dev_mismatched.tsv").unlink()
    with pytest.raises(ConfigError, match=r"validation_mismatched .*dev_mismatched\.tsv"):
        mnli.load_mnli(folder)
    with pytest.raises(ConfigError, match="not a folder"):
        mnli.load_mnli(tmp_path / "nowhere")
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(ConfigError, match="pip install datasets"):
        mnli.load_mnli(None)


def test_datasets_path_converts_glue_records(monkeypatch):
    """The network call itself cannot run here; a stand-in module returns GLUE/MNLI's records
    in the `datasets` layout (premise, hypothesis, label with -1 for no label)."""
    calls = []

    def load_dataset(*args):
        calls.append(args)
        row = {"premise": "A man sleeps.", "hypothesis": "A man rests.", "idx": 0}
        return {"train": [{**row, "label": 0}, {**row, "label": 2}, {**row, "label": -1}],
                "validation_matched": [{**row, "label": 1}],
                "validation_mismatched": [{**row, "label": 0}],
                "test_matched": [{**row, "label": -1}]}

    monkeypatch.setitem(sys.modules, "datasets",
                        types.SimpleNamespace(load_dataset=load_dataset))
    data = mnli.load_mnli(None, max_len=10)
    assert calls == [("glue", "mnli")]
    assert data.train.labels.tolist() == [0, 2]
    assert data.validation_matched.labels.tolist() == [1]
    v = data.tokenizer.vocab.index
    # max_len 10 leaves 7 words: the premise gets 7 // 2 = 3 of them, the hypothesis the rest
    assert data.train.ids[0].tolist() == [CLS, v("a"), v("man"), v("sleeps"), SEP, v("a"),
                                          v("man"), v("rests"), v("."), SEP]


def test_encoded_splits_are_cached_and_refreshed_when_files_change(tmp_path, monkeypatch):
    folder = _write_glue(tmp_path / "mnli")
    first = mnli.load_mnli(folder, max_len=16)

    def no_read(path):
        raise AssertionError("read although cached")

    monkeypatch.setattr(mnli, "_read_file", no_read)
    again = mnli.load_mnli(folder, max_len=16)
    assert torch.equal(first.train.ids, again.train.ids) and first.tokenizer == again.tokenizer
    with pytest.raises(AssertionError, match="cached"):
        mnli.load_mnli(folder, max_len=20)
    (folder / "dev_matched.tsv").write_text((folder / "dev_matched.tsv").read_text() + "\n\n")
    with pytest.raises(AssertionError, match="cached"):
        mnli.load_mnli(folder, max_len=16)
