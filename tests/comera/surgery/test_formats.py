"""convert_, checkpoints and save_pretrained folders for every registered format (the
user-declared ``einsum`` one has no dense conversion), and for a toy non-chain format registered
here (a hyperedge, a ring-like link, a fixed link: tests/comera/layers/toy_formats.py): an MLP
and a HuggingFace BERT convert, equal the dense model at full rank where the format decomposes
exactly, and round-trip through save_checkpoint / load_checkpoint and save_pretrained /
from_pretrained, into dense models and into models converted at other ranks (resized on
load)."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import nn

import comera
from comera.formats import registry
from comera.formats.layout import Layout
from comera.formats.registry import Format, format_names, get_format
from comera.layers.embedding import embedding_class, table_format
from comera.surgery import checkpoint
from comera.surgery.report import checkpoint_report
from tests.comera.layers.toy_formats import TOY

F64 = torch.float64


class TwoFactors(Format):
    """A format without modes (W = A B), as plain low-rank is: exercises the mode-less path."""

    name, title, uses_modes = "two-factors", "two factors", False

    def layout(self, in_modes, out_modes, ranks) -> Layout:
        (n,), (m,) = in_modes, out_modes
        rank = min(ranks, n, m) if isinstance(ranks, int) else ranks[0]
        return Layout(("i",), ("o",), (("i", "a"), ("a", "o")),
                      (("i", n), ("o", m), ("a", rank)), ("a",))


TWO = TwoFactors()


class Declared(Format):
    """A format that builds no layouts from modes (as a declared einsum network): a layer is
    made from a layout with GatedLinear.from_layout, its record is the layout as it stands."""

    name, title = "declared-test", "declared network"

    def layout(self, in_modes, out_modes, ranks) -> Layout:
        raise comera.ConfigError("declared-test has no layout from modes; use from_layout.")
FORMATS = [*(f for f in format_names() if get_format(f).from_modes), TOY.name, TWO.name]
FULL = 10**4  # above every bond cap here: the exact formats reproduce the dense layers
LOW = 3


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(24, 16, dtype=F64)
        self.fc2 = nn.Linear(16, 12, bias=False, dtype=F64)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


@pytest.fixture(autouse=True)
def _toy_registered(monkeypatch):
    format_names()  # the built-in formats first
    monkeypatch.setitem(registry.FORMATS, TOY.name, TOY)
    monkeypatch.setitem(registry.FORMATS, TWO.name, TWO)
    monkeypatch.setitem(registry.FORMATS, "declared-test", Declared())


def _rank(fmt: str) -> int:
    return FULL if get_format(fmt).exact_decomposition else LOW


def _convert(model: nn.Module, **options):
    with warnings.catch_warnings():  # full rank compresses nothing: said, and meant here
        warnings.simplefilter("ignore", UserWarning)
        return comera.convert_(model, **{"d": 2, **options})  # the toy format has 2 modes a side


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_mlp_converts_saves_and_loads_in_every_format(fmt, tmp_path):
    torch.manual_seed(0)
    model = MLP()
    dense = copy.deepcopy(model)
    x = torch.randn(5, 24, dtype=F64)
    report = _convert(model, ranks=_rank(fmt), format=fmt)
    assert [(r.name, r.format) for r in report.layers] == [("fc1", fmt), ("fc2", fmt)]
    assert model.fc1.format.name == fmt and model.fc2.format.name == fmt
    assert f" {fmt} " in str(report)
    with torch.no_grad():
        y = model(x)
        if get_format(fmt).exact_decomposition:
            torch.testing.assert_close(y, dense(x), rtol=1e-10, atol=1e-10)
    comera.save_checkpoint(tmp_path / "run.pt", model)
    comera.save_pretrained(model, tmp_path / "folder")
    for load in (lambda m: comera.load_checkpoint(tmp_path / "run.pt", m),
                 lambda m: comera.from_pretrained(tmp_path / "folder", m)):
        resized = MLP()
        _convert(resized, ranks=1, format=fmt)  # other bond sizes: resized on load
        for target in (MLP(), resized):
            load(target)
            assert target.fc1.format.name == fmt
            assert target.fc1.layout == model.fc1.layout
            with torch.no_grad():
                assert torch.equal(target(x), y)
    rows = {r.name: r for r in checkpoint_report(tmp_path / "run.pt").layers}
    assert rows["fc1"].format == fmt and rows["fc1"].bond_sizes == model.fc1.layout.bond_sizes


@pytest.mark.parametrize("fmt", FORMATS)
def test_target_compression_picks_the_largest_rank_under_budget_in_every_format(fmt):
    model = MLP()
    target = 3.0
    try:
        report = comera.convert_(model, target_compression=target, format=fmt, d=2)
    except comera.ConfigError as exc:  # even rank 1 is above for some layer: refused, naming it
        assert "cannot be reached" in str(exc) and f"({fmt}:" in str(exc)
        probe = MLP()
        rank_one = comera.convert_(probe, ranks=1, format=fmt, d=2)
        assert any(r.before / r.after < target for r in rank_one.layers), str(exc)
        assert all(type(m) is not type(probe.fc1) for m in (model.fc1,))  # model untouched
        return
    fmt_ = get_format(fmt)
    for r in report.layers:
        layout, bias = model.get_submodule(r.name).layout, model.get_submodule(r.name).bias
        kept = bias.numel() if bias is not None else 0  # on both sides, as compression_ratio
        budget = (r.shape[0] * r.shape[1] + kept) / target - kept
        rank = max(layout.bond_sizes)
        assert layout.parameters_at(layout.bond_sizes) <= budget, r.name
        bigger = fmt_.layout(layout.in_modes, layout.out_modes, rank + 1)
        assert (bigger.parameters_at(bigger.bond_sizes) > budget
                or bigger.bond_sizes == layout.bond_sizes), r.name


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_embedding_becomes_a_table_of_its_format(fmt):
    """The registry says how a format holds a table (TT: a TT-matrix TTEmbedding; any other
    format its own GatedEmbedding), so every format converts embeddings; at full rank an exact
    decomposition reproduces the table."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8, padding_idx=3, dtype=F64), nn.Linear(8, 4,
                                                                                dtype=F64))
    ids = torch.tensor([[0, 5, 19, 3], [3, 3, 7, 0]])
    with torch.no_grad():
        before = model(ids)
    report = _convert(model, embedding=True, ranks=_rank(fmt), format={"0": fmt, "*": "tt"})
    held = table_format(fmt)
    assert type(model[0]) is embedding_class(held) and model[0].format.name == held
    assert report.layers[0].format == held and model[0].padding_idx == 3
    if get_format(held).exact_decomposition:
        with torch.no_grad():
            torch.testing.assert_close(model(ids), before, rtol=1e-9, atol=1e-10)


def test_an_embedding_asked_for_a_format_without_tables_is_refused(monkeypatch):
    class NoTables(TwoFactors):
        name, table = "no-tables", None

    monkeypatch.setitem(registry.FORMATS, "no-tables", NoTables())
    assert "no-tables" not in registry.table_formats()
    model = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 4))
    with pytest.raises(comera.ConfigError, match=re.escape("format='no-tables' holds no "
                                                           "embedding tables; choose one of")):
        comera.convert_(model, embedding=True, format="no-tables", d=2)
    assert type(model[0]) is nn.Embedding and type(model[1]) is nn.Linear  # nothing swapped
    report = _convert(model, embedding=True, ranks=2, format={"0": "ttm", "*": "no-tables"})
    assert [r.format for r in report.layers] == ["ttm", "no-tables"]


@pytest.mark.parametrize("in_proj", ["split", "packed"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_an_attention_layer_round_trips_through_a_folder(fmt, in_proj, tmp_path):
    """nn.MultiheadAttention's projections (packed: one in_proj) in any format, the feed-forward
    in another: from_pretrained converts the dense attention with all its parts (the packed
    in_proj and out_proj failed to load before: they were converted in separate groups)."""
    pytest.importorskip("safetensors")

    def layer():
        torch.manual_seed(0)
        return nn.TransformerEncoderLayer(16, 2, 16, batch_first=True, dropout=0.0,
                                          dtype=F64).eval()

    model = layer()
    x = torch.randn(2, 5, 16, dtype=F64)
    _convert(model, ranks=LOW, format={"linear1": "tt", "*": fmt}, attention_in_proj=in_proj)
    assert model.self_attn.out_proj.format.name == fmt and model.linear1.format.name == "tt"
    comera.save_pretrained(model, tmp_path)
    loaded = comera.from_pretrained(tmp_path, layer())
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def _declared_mlp(bond: int) -> MLP:
    model = MLP()
    model.fc1 = comera.GatedLinear.from_layout(TOY.layout((4, 6), (4, 4), bond), "declared-test",
                                               dtype=F64)
    return model


def test_a_declared_network_saves_and_loads_into_a_model_that_has_it(tmp_path):
    """A layer of a format without layouts from modes (a declared einsum network) round-trips
    through a checkpoint and a folder into a model holding that layer at other bonds (resized
    on load); its layout is checked as a layout (a bond on no core is refused), not against
    the format."""
    torch.manual_seed(0)
    model = _declared_mlp(2)
    x = torch.randn(3, 24, dtype=F64)
    with torch.no_grad():
        y = model(x)
    comera.save_checkpoint(tmp_path / "run.pt", model)
    comera.save_pretrained(model, tmp_path / "folder")
    for load in (lambda m: comera.load_checkpoint(tmp_path / "run.pt", m),
                 lambda m: comera.from_pretrained(tmp_path / "folder", m)):
        target = _declared_mlp(3)
        load(target)
        assert target.fc1.format.name == "declared-test"
        with torch.no_grad():
            assert torch.equal(target(x), y)
    payload = torch.load(tmp_path / "run.pt", weights_only=True)
    payload["layers"]["fc1"]["layout"]["bonds"] = ["a", "e", "zz"]
    payload["checksum"] = checkpoint._checksum(payload)
    with pytest.raises(comera.CheckpointError, match="layout that does not parse"):
        comera.load_checkpoint(payload, _declared_mlp(2))


def test_a_declared_network_is_refused_by_a_model_that_lacks_it(tmp_path):
    """Issue 34, item 9: a record of a declared network (a structure from the file alone) does
    not take the place of a plain nn.Linear: loading says the model lacks that layer kind and
    how to build it, and changes nothing."""
    comera.save_checkpoint(tmp_path / "run.pt", _declared_mlp(2))
    comera.save_pretrained(_declared_mlp(2), tmp_path / "folder")
    for load in (lambda m: comera.load_checkpoint(tmp_path / "run.pt", m),
                 lambda m: comera.from_pretrained(tmp_path / "folder", m)):
        target = MLP()
        with pytest.raises(comera.CheckpointError,
                           match=r"fc1: the checkpoint holds a declared network layer \(format "
                                 r"'declared-test'\).*model lacks it.*GatedLinear\.from_eq"):
            load(target)
        assert type(target.fc1) is nn.Linear


def test_modes_for_a_format_without_modes_are_refused_before_any_swap():
    model = MLP()
    with pytest.raises(comera.ConfigError, match="uses no modes"):
        comera.convert_(model, format={"fc1": "tt", "*": TWO.name},
                        modes={"fc2": ((4, 4), (3, 4))}, ranks=2)
    assert type(model.fc1) is nn.Linear  # nothing swapped


transformers = pytest.importorskip("transformers")


def _bert():
    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=16,
                                     max_position_embeddings=16, num_labels=3)
    return transformers.BertForSequenceClassification(config)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_bert_converts_and_round_trips_in_every_format(fmt, tmp_path):
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    model = _bert().eval()
    dense = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 8))
    report = _convert(model, ranks=_rank(fmt), format=fmt)
    assert len(report.layers) >= 6 and {r.format for r in report.layers} == {fmt}
    with torch.no_grad():
        logits = model(ids).logits
        if get_format(fmt).exact_decomposition:
            torch.testing.assert_close(logits, dense(ids).logits, rtol=1e-4, atol=1e-5)
    comera.save_pretrained(model, tmp_path)
    loaded = comera.from_pretrained(tmp_path, type(model))
    assert {n: m.format.name for n, m in comera.gated_layers(loaded)} == \
        {n: m.format.name for n, m in comera.gated_layers(model)}
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)
