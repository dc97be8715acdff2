"""Saved folders and checkpoints edited with the checksum recomputed raise CheckpointError,
never a raw KeyError / AttributeError / RuntimeError, and never allocate what an edited record
asks for; HuggingFace's config.json is covered by the checksum (issue 26, item 5)."""

from __future__ import annotations

import copy
import json
import random
import resource

import pytest
import torch
from torch import nn

import comera
from comera.surgery import checkpoint as ckpt
from comera.surgery.pretrained import HF_CONFIG, RECORDS, WEIGHTS

st = pytest.importorskip("safetensors.torch")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(comera.TTLinear(16, 16, (4, 4), (4, 4), 3), nn.Tanh(),
                         comera.TTEmbedding(64, 8, ranks=3))


def _fresh() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Embedding(64, 8))


def _rewrite_records(folder, edit) -> None:
    """Apply ``edit`` to the folder's records and recompute their checksum, as an editor who
    knows the format would."""
    records = json.loads((folder / RECORDS).read_text())
    edit(records)
    tensors = st.load_file(folder / WEIGHTS)
    aliases = records.get("aliases") if isinstance(records.get("aliases"), dict) else {}
    tensors.update({a: tensors[t] for a, t in aliases.items() if t in tensors})
    payload = {"model": dict(sorted(tensors.items())), "layers": records.get("layers"),
               "optimizer": None, "optimizer_param_names": None,
               "extra": {"config_sha256": records.get("config_sha256")}}
    records["checksum"] = ckpt._checksum(payload)
    (folder / RECORDS).write_text(json.dumps(records))


def _set(path: list, value):
    def edit(records):
        target = records
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return edit


def _drop(path: list):
    def edit(records):
        target = records
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return edit


def _size(index: str, value, layer: str = "0"):
    """Set the size of ``index`` in the layout of the linear record ``layer``."""
    def edit(records):
        sizes = records["layers"][layer]["layout"]["sizes"]
        for entry in sizes:
            if entry[0] == index:
                entry[1] = value
    return edit


def _legacy(**changes):
    """Replace record 0 (a TT linear 16x16, modes (4, 4) x (4, 4), bonds (1, 3, 3, 3, 1)) by
    the record main wrote for it before the format protocol, with ``changes``."""
    def edit(records):
        records["layers"]["0"] = {
            "kind": "TTLinear", "in_features": 16, "out_features": 16, "in_modes": [4, 4],
            "out_modes": [4, 4], "bonds": [1, 3, 3, 3, 1], "tau": 0.01, "bias": True,
            "padding_idx": None, "merge_pairs": None, **changes}
    return edit


EDITS = {
    "huge-bonds": _size("r1", 4_000_000_000),
    "huge-but-int32-bonds": _size("r1", 2_000_000_000),
    "bonds-of-another-shape": _set(["layers", "2", "bonds"], [1, 5, 5, 1]),
    "bonds-as-text": _set(["layers", "0", "layout", "bonds"], "r1,r2"),
    "bond-a-feature-index": _set(["layers", "0", "layout", "bonds"], ["i1", "r2", "r3"]),
    "huge-features": _size("i1", 10**12),
    "modes-of-floats": _size("i1", 4.0),
    "inputs-swapped": _set(["layers", "0", "layout", "inputs"], ["i2", "i1"]),
    "cores-reordered": lambda r: r["layers"]["0"]["layout"]["cores"].reverse(),
    "format-of-another-layout": _set(["layers", "0", "format"], "ttm"),
    "unknown-format": _set(["layers", "0", "format"], "tt9"),
    "layout-not-a-dict": _set(["layers", "0", "layout"], 5),
    "no-layout": _drop(["layers", "0", "layout"]),
    "unknown-kind": _set(["layers", "0", "kind"], "TTConv"),
    "no-tau": _drop(["layers", "0", "tau"]),
    "tau-nan": _set(["layers", "0", "tau"], float("nan")),
    "record-not-a-dict": _set(["layers", "0"], 5),
    "layers-not-a-dict": _set(["layers"], [1, 2]),
    "layer-the-model-lacks": _set(["layers", "9"], None),
    "alias-to-nothing": _set(["aliases"], {"x.weight": "missing.weight"}),
    "aliases-not-a-dict": _set(["aliases"], 3),
    "no-checksum-field": _drop(["checksum"]),
    "legacy-huge-bonds": _legacy(bonds=[1, 4_000_000_000, 3, 3, 1]),
    "legacy-bonds-unlike-the-tensors": _legacy(bonds=[1, 2, 3, 3, 1]),
    "legacy-modes-of-floats": _legacy(in_modes=[4.0, 4.0]),
    "legacy-modes-unlike-features": _legacy(in_modes=[2, 4]),
    "legacy-open-ends": _legacy(bonds=[2, 3, 3, 3, 1]),
    "legacy-no-bonds": lambda r: (_legacy()(r), r["layers"]["0"].pop("bonds")),
}


# issue 34, item 8: every numeric field of both record kinds, out of its range (the layer's
# own rules: tau in [0, 1), sizes whole and at most int32, padding inside the table, flags bool)
RANGES = {
    ("0", "tau"): [1e300, 1.0, -1e-9, float("nan"), float("inf"), True, "0.01"],
    ("2", "tau"): [1e300, 1.0, -1.0],
    ("2", "padding_idx"): [64, -65, 2**40, 1.5, True],
    ("2", "in_features"): [0, -1, 2**40, 64.0],
    ("2", "out_features"): [0, 2**31, 7],
    ("2", "in_modes"): [[0, 64], [2**40], [4.0, 16]],
    ("2", "bonds"): [[1, -3, 1], [1, 2**33, 1], [1, 3.5, 1]],
    ("2", "merge_pairs"): [2, "yes"],
    ("0", "bias"): [1, "true"],
}


@pytest.mark.parametrize(("field", "value"), [
    pytest.param(field, value, id=f"{field[0]}.{field[1]}={value!r}")
    for field, values in RANGES.items() for value in values])
def test_every_numeric_field_of_a_record_is_range_checked(tmp_path, field, value):
    """A record edited to a value out of its field's range (checksum recomputed) is refused
    before anything is built; ``tau=1e300`` used to load and silently zero the layer."""
    comera.save_pretrained(_model(), tmp_path)
    _rewrite_records(tmp_path, _set(["layers", *field], value))
    with pytest.raises(comera.CheckpointError, match=r"damaged or was edited|does not match"):
        comera.from_pretrained(tmp_path, _fresh())


def test_a_tau_in_range_loads_as_recorded(tmp_path):
    comera.save_pretrained(_model(), tmp_path)
    _rewrite_records(tmp_path, _set(["layers", "0", "tau"], 0.5))
    assert comera.from_pretrained(tmp_path, _fresh())[0].tau == 0.5


def test_the_legacy_record_of_the_edits_is_the_one_main_wrote(tmp_path):
    """The legacy edits start from a record that loads: only their change is refused."""
    comera.save_pretrained(_model(), tmp_path)
    _rewrite_records(tmp_path, _legacy())
    loaded = comera.from_pretrained(tmp_path, _fresh())
    x = torch.randn(3, 16)
    assert torch.equal(loaded[0](x), _model()[0](x))


@pytest.mark.parametrize("name", list(EDITS))
def test_an_edited_pretrained_folder_is_a_checkpoint_error(tmp_path, name):
    comera.save_pretrained(_model(), tmp_path)
    if name == "layer-the-model-lacks":
        _rewrite_records(tmp_path, lambda r: r["layers"].__setitem__(
            "9", copy.deepcopy(r["layers"]["0"])))
    elif name == "no-checksum-field":
        _drop(["checksum"])(records := json.loads((tmp_path / RECORDS).read_text()))
        (tmp_path / RECORDS).write_text(json.dumps(records))
    else:
        _rewrite_records(tmp_path, EDITS[name])
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, hard))  # a huge allocation would fail
    try:
        with pytest.raises(comera.CheckpointError):
            comera.from_pretrained(tmp_path, _fresh())
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_an_unedited_folder_still_loads(tmp_path):
    model = _model()
    comera.save_pretrained(model, tmp_path)
    loaded = comera.from_pretrained(tmp_path, _fresh())
    x = torch.randn(3, 16)
    assert torch.equal(loaded[0](x), model[0](x))


def test_a_changed_hf_config_is_refused(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=16,
                                     max_position_embeddings=16, num_labels=3)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    with pytest.warns(UserWarning):
        comera.convert_(model, ranks=4, exclude=["classifier"])
    comera.save_pretrained(model, tmp_path)
    cls = transformers.BertForSequenceClassification
    comera.from_pretrained(tmp_path, cls)  # as saved: loads
    saved = json.loads((tmp_path / HF_CONFIG).read_text())
    assert saved["layer_norm_eps"] != 1.0
    (tmp_path / HF_CONFIG).write_text(json.dumps({**saved, "layer_norm_eps": 1.0}))
    with pytest.raises(comera.CheckpointError, match=r"config\.json changed"):
        comera.from_pretrained(tmp_path, cls)  # was loaded silently, outputs off
    (tmp_path / HF_CONFIG).unlink()
    with pytest.raises(comera.CheckpointError, match=r"lacks config\.json"):
        comera.from_pretrained(tmp_path, cls)


# -- checkpoints ----------------------------------------------------------------------------------
def _edited_checkpoint(tmp_path, edit):
    model = _model()
    optimizer = comera.make_optimizer(model)
    model[0](torch.randn(2, 16)).sum().backward()
    optimizer.step()
    path = tmp_path / "run.pt"
    comera.save_checkpoint(path, model, optimizer, engine={"step": 3})
    payload = torch.load(path, weights_only=True)
    edit(payload)
    payload["checksum"] = ckpt._checksum(payload)
    torch.save(payload, path)
    return path


CHECKPOINT_EDITS = {
    "huge-bonds": _size("r1", 4_000_000_000),
    "bonds-unlike-the-tensors": _size("r1", 2),
    "inputs-swapped": _set(["layers", "0", "layout", "inputs"], ["i2", "i1"]),
    "legacy-bonds-unlike-the-tensors": _legacy(bonds=[1, 2, 3, 3, 1]),
    "record-without-kind": lambda p: p["layers"]["0"].pop("kind"),
    "model-not-a-state-dict": lambda p: p.__setitem__("model", [1, 2]),
    "tensor-missing": lambda p: p["model"].pop("0.cores.1"),
    "extra-not-a-dict": lambda p: p.__setitem__("extra", 7),
    "optimizer-groups-garbled": lambda p: p["optimizer"].__setitem__("param_groups", 5),
    "optimizer-names-garbled": lambda p: p.__setitem__("optimizer_param_names", [[1, 2]]),
    "optimizer-state-garbled": lambda p: p["optimizer"].__setitem__("state", {0: 5}),
}


@pytest.mark.parametrize("name", list(CHECKPOINT_EDITS))
def test_an_edited_checkpoint_is_a_checkpoint_error(tmp_path, name):
    path = _edited_checkpoint(tmp_path, CHECKPOINT_EDITS[name])
    model = _fresh()
    with pytest.raises(comera.CheckpointError):
        comera.load_checkpoint(path, model, comera.make_optimizer(_model()))


@pytest.mark.parametrize("key, value", [("task", None), ("step", "3"), ("rng_python", 5),
                                        ("record", {"bogus": 1}), ("trainer", {"stage": 3})])
def test_an_edited_engine_state_is_refused_on_resume(tmp_path, key, value):
    from comera.experiments.engine import EngineConfig, train_model
    from tests.helpers.toy_task import ToyTask

    config = EngineConfig(steps_early=2, steps_late=0, batch_size=16, stage="early")
    train_model(ToyTask(), "comera", config, tmp_path, stop_after=1)
    path = tmp_path / "checkpoints" / "comera.pt"
    payload = torch.load(path, weights_only=True)
    payload["extra"]["engine"][key] = value
    payload["checksum"] = ckpt._checksum(payload)
    torch.save(payload, path)
    random.seed(0)
    with pytest.raises(comera.CheckpointError, match="damaged or was edited"):
        train_model(ToyTask(), "comera", config, tmp_path, resume=True)
