"""floor="measured": allocation="global" keeps the global or the uniform ranks by the converted
model's measured loss, records both losses, and leaves the model as the winner's conversion."""

from __future__ import annotations

import copy
import itertools
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import comera
from comera import ConvertConfig
from comera.errors import ConfigError
from comera.surgery.measured_loss import batch_loss, model_loss

F64 = torch.float64


class Regressor(nn.Module):
    """An MLP whose layers carry energy unevenly (so the two allocations differ); a batch is
    ``(x, y)`` and its output carries the mean squared error as ``.loss``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 32, dtype=F64)
        self.fc2 = nn.Linear(32, 32, dtype=F64)
        self.fc3 = nn.Linear(32, 8, dtype=F64)
        with torch.no_grad():  # fc1 nearly rank 2, fc2 full: the global spend moves ranks
            u, v = torch.randn(16, 2, dtype=F64), torch.randn(2, 32, dtype=F64)
            self.fc1.weight.copy_((u @ v).T + 0.01 * torch.randn(32, 16, dtype=F64))

    def forward(self, x, y=None):
        out = self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))
        loss = None if y is None else ((out - y) ** 2).mean()
        return SimpleNamespace(logits=out, loss=loss)


def _batches(n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    teacher = Regressor()
    out = []
    for _ in range(n):
        x = torch.randn(24, 16, generator=g, dtype=F64)
        with torch.no_grad():
            y = teacher(x).logits + 0.1 * torch.randn(24, 8, generator=g, dtype=F64)
        out.append((x, y))
    return out


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


BASE = {"format": "lowrank", "target_compression": 3.0}


def test_config_refuses_bad_floor_values():
    with pytest.raises(ConfigError, match="floor='best'"):
        ConvertConfig(allocation="global", target_compression=2, floor="best")
    with pytest.raises(ConfigError, match="allocation='global'"):
        ConvertConfig(target_compression=2, floor="measured")
    with pytest.raises(ConfigError, match="closed_form_refit=1"):
        ConvertConfig(closed_form_refit=1)


def test_refusals_leave_the_model_unchanged():
    model, batches = Regressor(), _batches()
    before = _state(model)
    with pytest.raises(ConfigError, match="pass calibration=batches"):
        comera.convert_(model, allocation="global", floor="measured", **BASE)
    with pytest.raises(ConfigError, match="only floor='measured' reads"):
        comera.convert_(model, calibration=batches, loss=lambda o, b: o.loss, **BASE)
    with pytest.raises(ConfigError, match="measure gave no batches"):
        comera.convert_(model, calibration=batches, measure=[], allocation="global",
                        floor="measured", **BASE)
    with pytest.raises(ConfigError, match="measurement batch 0 gave a SimpleNamespace"):
        comera.convert_(model, calibration=[x for x, _ in batches], allocation="global",
                        floor="measured", **BASE)  # no labels: no .loss
    with pytest.raises(ConfigError, match="shape \\(24, 8\\)"):
        comera.convert_(model, calibration=batches, allocation="global", floor="measured",
                        loss=lambda o, b: o.logits, **BASE)
    assert all(isinstance(m, nn.Linear) for m in (model.fc1, model.fc2, model.fc3))
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in after)


class Scripted:
    """A loss that returns the model's own loss plus a scripted offset per measurement pass
    (dense, uniform, global), so a test decides which candidate wins."""

    def __init__(self, offsets, per_pass):
        self.offsets, self.per_pass, self.calls = offsets, per_pass, 0

    def __call__(self, output, batch):
        offset = self.offsets[self.calls // self.per_pass]
        self.calls += 1
        return output.loss + offset


@pytest.mark.parametrize("winner", ["uniform", "global"])
def test_the_lower_measured_loss_wins_and_the_model_is_its_conversion(winner):
    batches = _batches()
    # the references: the uniform allocation's calibrated conversion, and the global spend's
    uniform_ref, global_ref = Regressor(), Regressor()
    comera.convert_(uniform_ref, calibration=batches, **BASE)
    report_g = comera.convert_(global_ref, calibration=batches, allocation="global", **BASE)
    assert report_g.kept == "global"  # precondition: the estimate keeps the spend here
    assert [r.ranks for r in report_g.layers] != [
        r.ranks for r in comera.convert_(Regressor(), calibration=batches, **BASE).layers]
    offsets = (0.0, 0.0, 1.0) if winner == "uniform" else (0.0, 1.0, 0.0)
    loss = Scripted(offsets, len(batches))
    model = Regressor()
    report = comera.convert_(model, calibration=batches, allocation="global", floor="measured",
                             loss=loss, **BASE)
    assert loss.calls == 3 * len(batches)  # dense, uniform, global: one pass each
    assert report.kept == winner and report.measured_batches == len(batches)
    assert _same(model, uniform_ref if winner == "uniform" else global_ref)
    losses = dict(report.losses)
    assert set(losses) == {"dense", "uniform", "global"}
    assert losses[winner] < losses["global" if winner == "uniform" else "uniform"]
    text = str(report)
    assert f"ranks: the {winner} allocation's (floor='measured'" in text
    assert f"{losses['uniform']:.4f}" in text and f"{losses['global']:.4f}" in text


def test_recorded_losses_are_the_models_losses():
    batches, held_out = _batches(), _batches(3, seed=7)
    model, dense = Regressor(), Regressor()
    report = comera.convert_(model, calibration=iter(batches), measure=held_out,
                             allocation="global", floor="measured", **BASE)
    losses = dict(report.losses)
    assert losses["dense"] == model_loss(dense, held_out)
    assert losses[report.kept] == pytest.approx(model_loss(model, held_out), rel=1e-12)
    other = "global" if report.kept == "uniform" else "uniform"
    assert losses[report.kept] <= losses[other]
    # measured on the held-out batches, not on the calibration ones
    assert losses["dense"] != model_loss(dense, batches)
    # a generator of calibration batches is held for the second pass when it is measured too
    again = Regressor()
    report2 = comera.convert_(again, calibration=(b for b in batches), allocation="global",
                              floor="measured", **BASE)
    assert dict(report2.losses)["dense"] == model_loss(Regressor(), batches)
    assert report2.batches == len(batches)


def test_equal_candidates_are_measured_once():
    # one layer at a budget only rank 1 fits: both allocations give it the same bond
    model = nn.Sequential(nn.Linear(8, 8, dtype=F64))
    data = [(torch.randn(4, 8, dtype=F64),) for _ in range(2)]
    loss = Scripted((0.0, 0.0, 0.0), len(data))
    report = comera.convert_(model, calibration=data, allocation="global", floor="measured",
                             format="lowrank", target_compression=2.0,
                             loss=lambda o, b: loss(SimpleNamespace(loss=o.square().mean()), b))
    assert loss.calls == 2 * len(data)
    losses = dict(report.losses)
    assert losses["uniform"] == losses["global"] and report.kept == "uniform"


def test_batch_loss_reads_the_output():
    assert batch_loss(SimpleNamespace(loss=torch.tensor(2.5)), None) == 2.5
    assert batch_loss({"loss": torch.tensor(1.5)}, None) == 1.5
    assert batch_loss(torch.tensor(0.5), None) == 0.5
    with pytest.raises(ConfigError, match="a tensor of shape \\(2, 3\\)"):
        batch_loss(torch.zeros(2, 3), None)


def test_a_huggingface_model_is_measured_by_its_own_loss():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1,
                                     n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = [torch.randint(0, 64, (2, 16)) for _ in range(3)]
    batches = [{"input_ids": x, "labels": x} for x in ids]
    dense = copy.deepcopy(model)
    with pytest.warns(UserWarning):
        report = comera.convert_(model, calibration=batches, allocation="global",
                                 floor="measured", format="lowrank", target_compression=2.0,
                                 exclude=["lm_head"])
    losses = dict(report.losses)
    with torch.no_grad():
        expected = sum(float(dense(**b).loss) for b in batches) / len(batches)
        kept = sum(float(model(**b).loss) for b in batches) / len(batches)
    assert losses["dense"] == pytest.approx(expected, rel=1e-6)
    assert losses[report.kept] == pytest.approx(kept, rel=1e-6)


def test_cost_is_one_decomposition_per_candidate(monkeypatch):
    import comera.surgery.measured_floor as floor

    calls = []
    original = floor.decompose_parts_
    monkeypatch.setattr(floor, "decompose_parts_",
                        lambda *a, **k: calls.append(k["bonds"]) or original(*a, **k))
    comera.convert_(Regressor(), calibration=_batches(), allocation="global", floor="measured",
                    **BASE)
    assert len(calls) == 2 and calls[0] != calls[1]
    assert list(itertools.chain(calls[0])) == ["fc1", "fc2", "fc3"]


def test_comera_convert_reports_the_measured_floor(tmp_path):
    from tests.comera.test_cli import run_cli

    torch.save(Regressor(), tmp_path / "model.pt")
    torch.save(_batches(), tmp_path / "calib.pt")
    done = run_cli("convert", str(tmp_path / "model.pt"), "-o", str(tmp_path / "out.pt"),
                   "--calibration", str(tmp_path / "calib.pt"), "--set", "format=lowrank",
                   "--set", "target_compression=3", "--set", "allocation=global", "--set",
                   "floor=measured", "--set", "closed_form_refit=true", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "(floor='measured': loss" in done.stdout and "on 4 measurement batch(es)" in done.stdout
    done = run_cli("convert", str(tmp_path / "model.pt"), "-o", str(tmp_path / "out2.pt"),
                   "--set", "format=lowrank", "--set", "target_compression=3", "--set",
                   "allocation=global", "--set", "floor=measured", cwd=tmp_path)
    assert done.returncode == 2 and "pass calibration=batches" in done.stderr
    assert not (tmp_path / "out2.pt").exists()
