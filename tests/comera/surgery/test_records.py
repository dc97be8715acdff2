"""The GatedEmbedding record (a table in any format that holds one): what it holds, and every
field of it edited out of range (checksum recomputed) is refused before anything is built or
allocated, as the other record kinds are (tests/comera/surgery/test_tampered.py)."""

from __future__ import annotations

import resource

import pytest
import torch
from torch import nn

import comera
from comera.layers.embedding import GatedEmbedding, gated_embedding
from comera.surgery.records import TABLE_KEYS, layer_spec, record_problem
from tests.comera.surgery.test_tampered import _drop, _rewrite_records, _set

pytest.importorskip("safetensors.torch")

ROWS, DIM, PAD = 29, 12, 4  # 29 rows: the Tucker table's modes cover 30 (one padded row)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(gated_embedding(ROWS, DIM, "tucker", ranks=3, padding_idx=PAD, d=2),
                         gated_embedding(ROWS, DIM, "lowrank", ranks=3))


def _fresh() -> nn.Module:
    return nn.Sequential(nn.Embedding(ROWS, DIM, padding_idx=PAD), nn.Embedding(ROWS, DIM))


def test_the_record_holds_format_layout_rows_padding_and_tau():
    model = _model()
    spec = layer_spec(model[0])
    assert type(model[0]) is GatedEmbedding and set(spec) == {"kind", *TABLE_KEYS}
    assert spec["kind"] == "GatedEmbedding" and spec["format"] == "tucker"
    assert (spec["num_embeddings"], spec["padding_idx"]) == (ROWS, PAD)
    assert spec["layout"] == model[0].layout.to_dict() and spec["tau"] == model[0].tau
    assert spec["layout"]["sizes"][:2] == [["i1", 5], ["i2", 6]]  # rows padded to 30
    assert record_problem(spec) is None and record_problem(layer_spec(model[1])) is None


def _size(index: str, value, layer: str = "0"):
    def edit(records):
        for entry in records["layers"][layer]["layout"]["sizes"]:
            if entry[0] == index:
                entry[1] = value
    return edit


EDITS = {
    "num_embeddings-0": _set(["layers", "0", "num_embeddings"], 0),
    "num_embeddings-negative": _set(["layers", "0", "num_embeddings"], -1),
    "num_embeddings-beyond-the-layout": _set(["layers", "0", "num_embeddings"], 31),
    "num_embeddings-huge": _set(["layers", "0", "num_embeddings"], 2**40),
    "num_embeddings-float": _set(["layers", "0", "num_embeddings"], 29.0),
    "num_embeddings-bool": _set(["layers", "0", "num_embeddings"], True),
    "num_embeddings-text": _set(["layers", "0", "num_embeddings"], "29"),
    "num_embeddings-unlike-the-model": _set(["layers", "0", "num_embeddings"], 30),
    "lowrank-rows-unlike-its-mode": _set(["layers", "1", "num_embeddings"], 28),
    "padding_idx-past-the-rows": _set(["layers", "0", "padding_idx"], ROWS),
    "padding_idx-negative": _set(["layers", "0", "padding_idx"], -1),
    "padding_idx-huge": _set(["layers", "0", "padding_idx"], 2**40),
    "padding_idx-float": _set(["layers", "0", "padding_idx"], 1.5),
    "padding_idx-bool": _set(["layers", "0", "padding_idx"], True),
    "padding_idx-unlike-the-model": _set(["layers", "0", "padding_idx"], PAD + 1),
    "tau-huge": _set(["layers", "0", "tau"], 1e300),
    "tau-one": _set(["layers", "0", "tau"], 1.0),
    "tau-negative": _set(["layers", "0", "tau"], -1.0),
    "tau-nan": _set(["layers", "0", "tau"], float("nan")),
    "format-without-tables": _set(["layers", "0", "format"], "einsum"),
    "format-unknown": _set(["layers", "0", "format"], "tuker"),
    "format-of-another-layout": _set(["layers", "0", "format"], "cp"),
    "format-not-text": _set(["layers", "0", "format"], 5),
    "layout-not-a-dict": _set(["layers", "0", "layout"], 5),
    "layout-cores-reordered": lambda r: r["layers"]["0"]["layout"]["cores"].reverse(),
    "huge-bond": _size("a1", 4_000_000_000),
    "bond-unlike-the-tensors": _size("a1", 2),
    "huge-rows": _size("i1", 10**12),
    **{f"no-{key}": _drop(["layers", "0", key]) for key in TABLE_KEYS},
}


@pytest.mark.parametrize("name", list(EDITS))
def test_an_edited_table_record_is_refused_before_anything_is_built(tmp_path, name):
    model = _fresh()
    comera.save_pretrained(_model(), tmp_path)
    _rewrite_records(tmp_path, EDITS[name])
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, hard))  # a huge allocation would fail
    try:
        with pytest.raises(comera.CheckpointError, match=r"damaged or was edited|does not match"):
            comera.from_pretrained(tmp_path, model)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert all(type(m) is nn.Embedding for m in model)  # nothing was changed


def test_an_unedited_table_folder_loads(tmp_path):
    saved = _model()
    comera.save_pretrained(saved, tmp_path)
    _rewrite_records(tmp_path, lambda r: None)  # the rewrite alone changes nothing
    loaded = comera.from_pretrained(tmp_path, _fresh())
    ids = torch.arange(ROWS)
    assert all(torch.equal(a(ids), b(ids)) for a, b in zip(loaded, saved, strict=True))
