"""Checkpoints (comera.surgery.checkpoint): truncated models load into any version of the same
model."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

import comera
from comera.errors import CheckpointError
from comera.formats.layout import Layout
from comera.surgery.checkpoint import (
    STALE_TEMP_S,
    CheckpointRecord,
    load_checkpoint,
    save_checkpoint,
)
from tncomp.files import TEMP_SUFFIX

F64 = torch.float64


class Net(nn.Module):
    """Embedding -> Linear -> Linear -> head; emb/a/b are converted, head stays dense."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 12, padding_idx=0, dtype=F64)
        self.a = nn.Linear(12, 16, dtype=F64)
        self.b = nn.Linear(16, 8, dtype=F64)
        self.head = nn.Linear(8, 3, dtype=F64)

    def forward(self, ids):
        return self.head(torch.relu(self.b(torch.relu(self.a(self.emb(ids))))))


def _convert_(model):
    comera.convert_(model, include=["emb", "a"], embedding=True, ranks=6)
    comera.convert_(model, include=["b"], ranks=4, format="ttm")
    return model


def _train(model, opt, ids, steps=3):
    for _ in range(steps):
        opt.zero_grad()
        model(ids).square().mean().backward()
        opt.step()


def _state_by_name(model, opt):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def trained(tmp_path):
    """A converted, trained and truncated model, its AdamW and its saved checkpoint."""
    torch.manual_seed(0)
    model = _convert_(Net())
    opt = comera.make_optimizer(model)
    ids = torch.randint(0, 30, (5, 4))
    _train(model, opt, ids)
    with torch.no_grad():  # prune the last slice of every bond that has more than one
        for _, layer in comera.gated_layers(model):
            for gate in layer.gates:
                if gate.numel() > 1:
                    gate[-1] = 0.5 * layer.tau
    comera.truncate_(model, opt)
    _train(model, opt, ids, steps=2)
    path = tmp_path / "run.pt"
    save_checkpoint(path, model, opt, step=5, note="truncated")
    with torch.no_grad():
        y = model(ids)
    return {"model": model, "opt": opt, "ids": ids, "y": y, "path": path,
            "bonds": {n: m.bonds for n, m in comera.gated_layers(model)},
            "state": _state_by_name(model, opt)}


def _assert_loaded(t, model, opt):
    with torch.no_grad():
        torch.testing.assert_close(model(t["ids"]), t["y"], rtol=1e-12, atol=1e-12)
    assert {n: m.bonds for n, m in comera.gated_layers(model)} == t["bonds"]
    if opt is None:
        return
    state = _state_by_name(model, opt)
    assert state.keys() == t["state"].keys()
    for name, saved in t["state"].items():
        assert state[name].keys() == saved.keys()
        for key, value in saved.items():
            torch.testing.assert_close(state[name][key], value, rtol=0, atol=0)
    assert [g["name"] for g in opt.param_groups] == ["cores", "gates", "other"]
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {
        id(p) for p in model.parameters()}


def _same_next_step(t, model, opt):
    """One more AdamW step from the original and from the loaded copy gives the same weights."""
    _train(t["model"], t["opt"], t["ids"], steps=1)
    _train(model, opt, t["ids"], steps=1)
    mine = dict(model.named_parameters())
    for name, p in t["model"].named_parameters():
        torch.testing.assert_close(mine[name], p, rtol=1e-12, atol=1e-12)


def test_load_into_the_same_object(trained):
    model, opt = trained["model"], trained["opt"]
    _train(model, opt, trained["ids"], steps=2)  # move away from the saved point
    extra = load_checkpoint(trained["path"], model, opt)
    assert extra == {"step": 5, "note": "truncated"}
    _assert_loaded(trained, model, opt)


def test_load_into_a_fresh_untruncated_model(trained):
    torch.manual_seed(1)
    model = _convert_(Net())
    assert {n: m.bonds for n, m in comera.gated_layers(model)} != trained["bonds"]
    opt = comera.make_optimizer(model)  # built before the load, over the untruncated cores
    load_checkpoint(trained["path"], model, opt)
    _assert_loaded(trained, model, opt)
    _same_next_step(trained, model, opt)


def test_load_into_a_fresh_unconverted_model(trained):
    torch.manual_seed(2)
    model = Net()
    opt = torch.optim.AdamW(model.parameters())  # over the dense weights: groups are rebuilt
    extra = load_checkpoint(trained["path"], model, opt)
    assert extra["step"] == 5
    assert isinstance(model.emb, comera.TTEmbedding) and model.emb.padding_idx == 0
    assert isinstance(model.a, comera.TTLinear) and isinstance(model.b, comera.TTMLinear)
    assert isinstance(model.head, nn.Linear)
    _assert_loaded(trained, model, opt)
    _same_next_step(trained, model, opt)


def test_load_without_optimizer_and_restores_tau(trained):
    torch.manual_seed(3)
    model = _convert_(Net())
    model.a.tau = 0.5
    assert load_checkpoint(trained["path"], model) == {"step": 5, "note": "truncated"}
    assert model.a.tau == trained["model"].a.tau
    _assert_loaded(trained, model, None)


def test_load_from_a_dict(trained):
    payload = torch.load(trained["path"], weights_only=True)
    model = Net()
    load_checkpoint(payload, model)
    _assert_loaded(trained, model, None)


def test_optimizer_without_saved_state(trained, tmp_path):
    path = tmp_path / "no-opt.pt"
    save_checkpoint(path, trained["model"])
    model = Net()
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        load_checkpoint(path, model, torch.optim.AdamW(model.parameters()))
    assert isinstance(model.a, nn.Linear)  # checked before anything changed


def test_optimizer_of_another_class(trained):
    model = Net()
    with pytest.raises(CheckpointError, match="AdamW optimizer, got a SGD"):
        load_checkpoint(trained["path"], model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_optimizer_over_other_parameters_cannot_be_saved(tmp_path):
    model = _convert_(Net())
    opt = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    with pytest.raises(CheckpointError, match="not in the model"):
        save_checkpoint(tmp_path / "x.pt", model, opt)
    assert os.listdir(tmp_path) == []


# -- damaged and foreign files --------------------------------------------------------------------
def _expect_rejected(path, match):
    model = Net()
    with pytest.raises(CheckpointError, match=match) as info:
        load_checkpoint(path, model)
    assert str(path) in str(info.value)
    assert isinstance(model.a, nn.Linear)  # nothing was loaded


def test_random_bytes(tmp_path):
    path = tmp_path / "noise.pt"
    path.write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    _expect_rejected(path, "cannot be read")


def test_truncated_file(trained):
    data = trained["path"].read_bytes()
    trained["path"].write_bytes(data[: len(data) // 2])
    _expect_rejected(trained["path"], "truncated, corrupt")


def test_unrelated_torch_file(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(3), "epoch": 1}, path)
    _expect_rejected(path, "not a comera checkpoint")
    torch.save(nn.Linear(2, 2).state_dict(), path)
    _expect_rejected(path, "not a comera checkpoint")


def test_tampered_tensor_with_stale_checksum(trained):
    payload = torch.load(trained["path"], weights_only=True)
    payload["model"]["a.cores.2"][0, 0, 0] += 1e-9
    torch.save(payload, trained["path"])
    _expect_rejected(trained["path"], "fails its checksum")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(trained["path"], Net())
    # the checksum sits in the file: it detects damage, and claims nothing about tampering
    assert "contents changed after it was saved" in str(info.value)
    assert "weights were changed" not in str(info.value)
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(payload, Net())


def test_tampered_layer_record_and_optimizer_state(trained):
    payload = torch.load(trained["path"], weights_only=True)
    payload["layers"]["b"]["tau"] = 0.3
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(payload, Net())
    payload = torch.load(trained["path"], weights_only=True)
    next(iter(payload["optimizer"]["state"].values()))["exp_avg"].mul_(2)
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(payload, Net())


def test_newer_version(trained):
    payload = torch.load(trained["path"], weights_only=True)
    payload["version"] = comera.surgery.checkpoint.VERSION + 1
    with pytest.raises(CheckpointError, match=f"version {comera.surgery.checkpoint.VERSION + 1}"):
        load_checkpoint(payload, Net())


def test_empty_file_and_whole_pickled_model(tmp_path):
    path = tmp_path / "empty.pt"
    path.write_bytes(b"")
    _expect_rejected(path, r"not a torch file \(NotATorchFileError: not a torch file: it is empty")
    torch.save(Net(), path)  # a whole model: pickled classes, never unpickled here
    _expect_rejected(path, r"holds pickled Python objects "
                     r"\(tests\.comera\.surgery\.test_checkpoint\.Net\)")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, Net())
    assert "\x1b" not in str(info.value) and "\n" not in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pt", Net())


# -- models that do not match ---------------------------------------------------------------------
def test_layer_missing_from_the_model(trained):
    class Smaller(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(30, 12, padding_idx=0, dtype=F64)
            self.head = nn.Linear(8, 3, dtype=F64)

    with pytest.raises(CheckpointError, match="the model lacks: a, b"):
        load_checkpoint(trained["path"], Smaller())


def test_layer_of_other_shape_or_modes(trained):
    model = Net()
    model.a = nn.Linear(12, 20, dtype=F64)
    with pytest.raises(CheckpointError, match=r"a: \(in, out, bias\) are \(12, 20, True\)"):
        load_checkpoint(trained["path"], model)
    model = Net()
    model.a = comera.TTLinear(12, 16, (3, 2, 2), (4, 2, 2), ranks=3, dtype=F64)
    with pytest.raises(CheckpointError, match="in_modes"):
        load_checkpoint(trained["path"], model)
    model = Net()
    model.b = comera.TTLinear(16, 8, (2, 2, 4), (2, 2, 2), ranks=3, dtype=F64)
    with pytest.raises(CheckpointError, match="has format tt, the checkpoint's ttm"):
        load_checkpoint(trained["path"], model)


def test_other_entries_checked_before_changing_the_model(trained):
    model = Net()
    model.head = nn.Linear(8, 4, dtype=F64)
    with pytest.raises(CheckpointError, match=r"head.weight: \(3, 8\) in the checkpoint"):
        load_checkpoint(trained["path"], model)
    assert isinstance(model.a, nn.Linear)
    model = Net()
    model.extra = nn.Linear(2, 2, dtype=F64)
    with pytest.raises(CheckpointError, match=r"extra\.weight: missing from the checkpoint"):
        load_checkpoint(trained["path"], model)
    load_checkpoint(trained["path"], model, strict=False)
    assert isinstance(model.a, comera.TTLinear)


# -- atomic writes --------------------------------------------------------------------------------
def test_atomic_write_leaves_no_temporary_files(trained, tmp_path):
    assert os.listdir(tmp_path) == ["run.pt"]
    save_checkpoint(trained["path"], trained["model"], trained["opt"], step=6)  # overwrite
    assert os.listdir(tmp_path) == ["run.pt"]
    assert load_checkpoint(trained["path"], Net())["step"] == 6


def _temp_file(path, age_s):
    """A temp file as tncomp.files.atomic_write_bytes names it, last written ``age_s`` ago."""
    tmp = path.parent / f".{path.name}.4242-{'0' * 16}{TEMP_SUFFIX}"
    tmp.write_bytes(b"x" * 1000)
    when = time.time() - age_s
    os.utime(tmp, (when, when))
    return tmp


@pytest.mark.parametrize("action", ["save", "load"])
def test_stale_temp_files_of_a_killed_writer_are_swept(trained, tmp_path, action):
    stale = _temp_file(trained["path"], age_s=STALE_TEMP_S + 60)  # left by a SIGKILLed save
    fresh = _temp_file(trained["path"], age_s=1).rename(
        tmp_path / f".run.pt.4343-{'1' * 16}{TEMP_SUFFIX}")  # a concurrent writer's, in flight
    other = _temp_file(tmp_path / "other.pt", age_s=STALE_TEMP_S + 60)  # not this checkpoint's
    if action == "save":
        save_checkpoint(trained["path"], trained["model"], trained["opt"], step=6)
    else:
        load_checkpoint(trained["path"], Net())
    assert not stale.exists()
    assert fresh.exists() and other.exists()


def test_stale_temp_files_of_the_old_format_are_swept(trained, tmp_path):
    old = tmp_path / ".run.pt.0123456789ab.tmp"  # how checkpoint temp files were named before
    old.write_bytes(b"x" * 1000)
    when = time.time() - STALE_TEMP_S - 60
    os.utime(old, (when, when))
    young = tmp_path / ".run.pt.ba9876543210.tmp"
    young.write_bytes(b"x")
    load_checkpoint(trained["path"], Net())
    assert not old.exists() and young.exists()


def test_read_checkpoint_returns_the_verified_contents(trained):
    record = comera.read_checkpoint(trained["path"])
    assert isinstance(record, CheckpointRecord)
    assert record.path == str(trained["path"])
    assert record.version == comera.surgery.checkpoint.VERSION
    assert record.extra == {"step": 5, "note": "truncated"}
    assert set(record.layers) == {"emb", "a", "b"}
    layout = Layout.from_dict(record.layers["a"]["layout"])
    assert record.layers["a"]["format"] == "tt"
    assert (1, *layout.bond_sizes, 1) == trained["bonds"]["a"]
    assert record.optimizer_class == "AdamW"
    assert record.model.keys() == trained["model"].state_dict().keys()


def test_failed_write_keeps_the_old_file(trained, tmp_path, monkeypatch):
    before = trained["path"].read_bytes()

    def broken_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(CheckpointError, match="disk full"):
        save_checkpoint(trained["path"], trained["model"])
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["run.pt"]
    assert trained["path"].read_bytes() == before


def test_extra_must_be_plain_data(trained, tmp_path):
    with pytest.raises(CheckpointError, match=r"extra\['config'\] is a OptimizerConfig"):
        save_checkpoint(tmp_path / "x.pt", trained["model"], config=comera.OptimizerConfig())
    assert os.listdir(tmp_path) == ["run.pt"]


def test_save_into_a_missing_directory(trained, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist; create it first"):
        save_checkpoint(tmp_path / "no" / "x.pt", trained["model"])


def test_an_einsum_layer_loads_only_into_a_model_that_has_one(tmp_path):
    """Issue 34, item 9: a checkpoint holding a declared einsum layer, loaded into a plain
    nn.Linear model, says the model lacks that layer kind (it used to put the file's network
    in its place, whatever it costs to run); into a model declaring it, it loads."""
    def declared(rank: int) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(comera.GatedLinear.from_eq(
            "b i j, i a, a j k -> b k", bonds="a", sizes={"i": 4, "j": 8, "k": 16}, ranks=rank))

    model = declared(8)
    save_checkpoint(tmp_path / "e.pt", model)
    plain = nn.Sequential(nn.Linear(32, 16))
    with pytest.raises(CheckpointError, match=r"0: the checkpoint holds a declared einsum layer "
                                              r"\(format 'einsum'\).*the model lacks it"):
        load_checkpoint(tmp_path / "e.pt", plain)
    assert type(plain[0]) is nn.Linear
    target = declared(2)
    load_checkpoint(tmp_path / "e.pt", target)
    x = torch.randn(3, 32)
    assert torch.equal(target(x), model(x))


def test_swapped_arguments_say_the_order_and_touch_nothing(tmp_path):
    """Issue 34, item 13: save_checkpoint(model, path), convert_("model.pt") and
    save_pretrained(folder, model) gave raw Python errors; each now says which argument is
    which, before anything is read or written."""
    model = nn.Sequential(comera.TTLinear(16, 16, (4, 4), (4, 4), 2))
    path, folder = tmp_path / "run.pt", tmp_path / "folder"
    calls = [
        (lambda: save_checkpoint(model, path), r"save_checkpoint: model is a PosixPath .*"
                                               r"save_checkpoint\(path, model"),
        (lambda: save_checkpoint(path, model, model), "optimizer"),
        (lambda: load_checkpoint(model, path), r"load_checkpoint: model is a PosixPath"),
        (lambda: comera.convert_("model.pt"), r"convert_: model is a str \('model\.pt'\)"),
        (lambda: comera.save_pretrained(folder, model), r"save_pretrained: model is a "
                                                        r"PosixPath.*save_pretrained\(model, "
                                                        r"directory\)"),
        (lambda: comera.save_pretrained(model, model), r"directory is a Sequential"),
        (lambda: comera.from_pretrained(model, folder), r"from_pretrained: directory is a "
                                                        r"Sequential"),
    ]
    for call, said in calls:
        with pytest.raises((comera.ConfigError, CheckpointError), match=said):
            call()
    assert list(tmp_path.iterdir()) == []
