"""CoMERACallback in a real lightning.Trainer.fit on a tiny converted network: both stages to
a compression target, logged metrics, and a checkpoint of the truncated model that resumes
exactly (and that load_from_checkpoint refuses rather than loading part of it)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import comera

pl = pytest.importorskip("lightning.pytorch")
from comera.integrations.lightning import CoMERACallback  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TARGET, LATE_START, STEPS = 4.0, 3, 8  # one batch per epoch (Lightning replays the batch
# order differently after a resume; with one batch the order cannot differ)


class Regression(pl.LightningModule):
    def __init__(self, seed: int = 0):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            comera.convert_(self.net, ranks=8, include=["0"])
        with torch.no_grad():  # a rank already pruned, as an early stage would
            self.net[0].gates[1][:1] = 0.0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def _trainer(out, limit: dict | None = None, **callback) -> pl.Trainer:
    """A trainer of STEPS optimizer steps (``limit``: other Trainer limits, e.g. max_epochs)."""
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=out, every_n_epochs=1, save_top_k=-1,
                                               filename="{epoch}")
    callback = {"target_compression": TARGET, "late_start": LATE_START, **callback}
    return pl.Trainer(**(limit or {"max_steps": STEPS}), accelerator="cpu", devices=1,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[CoMERACallback(**callback), checkpoints])


def _callback(trainer: pl.Trainer) -> CoMERACallback:
    return next(c for c in trainer.callbacks if isinstance(c, CoMERACallback))


@pytest.fixture(scope="module")
def run(tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("lightning")
    module = Regression()
    trainer = _trainer(out)
    trainer.fit(module, _data())
    return {"module": module, "trainer": trainer, "out": out}


def test_both_stages_reach_the_compression_target(run):
    module = run["module"]
    callback = next(c for c in run["trainer"].callbacks if isinstance(c, CoMERACallback))
    assert callback.driver.controller.stage == "late"
    assert callback.driver.controller.steps == STEPS
    assert comera.compression_ratio(module, only=comera.GatedLayer) >= 0.95 * TARGET
    assert module.net[0].bonds != Regression().net[0].bonds  # truncated physically


def test_metrics_hold_the_objective_size_compression_and_ranks(run):
    metrics = run["trainer"].callback_metrics
    for key in ("objective", "size", "compression", "rank_total", "late_stage"):
        assert f"comera/{key}" in metrics, key
    assert float(metrics["comera/late_stage"]) == 1.0
    assert float(metrics["comera/size"]) == comera.model_size(run["module"])


def test_the_logged_compression_is_the_one_the_target_refers_to(run):
    """Issue 34, item 1: ``comera/compression`` is the TT layers' (what target_compression
    means); the whole model's is ``comera/model_compression``."""
    metrics, module = run["trainer"].callback_metrics, run["module"]
    tt = comera.compression_ratio(module, only=comera.GatedLayer)
    assert float(metrics["comera/compression"]) == pytest.approx(tt, rel=1e-5)
    assert float(metrics["comera/compression"]) >= 0.95 * TARGET
    whole = float(metrics["comera/model_compression"])
    assert whole == pytest.approx(comera.compression_ratio(module), rel=1e-5)
    assert whole < 0.95 * TARGET  # the dense second layer counts there


def test_a_late_start_at_max_steps_is_a_warning_when_training_begins(tmp_path):
    """Issue 34, item 6: the late stage cannot run: said when training begins and when it ends,
    and no stage without steps is started."""
    trainer = _trainer(tmp_path, late_start=STEPS)
    with pytest.warns(UserWarning) as seen:
        trainer.fit(Regression(), _data())
    said = [str(w.message) for w in seen]
    assert any(f"late_start={STEPS} is at or past the trainer's max_steps={STEPS}" in m
               for m in said), said
    assert any("the late stage never began" in m for m in said), said
    assert _callback(trainer).driver.controller.stage == "early"


def test_a_run_limited_by_max_epochs_alone_is_checked_when_training_begins(tmp_path):
    """A Trainer with max_epochs and no max_steps (max_steps=-1): its optimizer steps are known
    when training begins (one batch an epoch here), so a late_start past them is said then,
    as with max_steps."""
    trainer = _trainer(tmp_path, {"max_epochs": STEPS}, late_start=STEPS)
    with pytest.warns(UserWarning) as seen:
        trainer.fit(Regression(), _data())
    said = [str(w.message) for w in seen]
    assert trainer.max_steps == -1 and trainer.global_step == STEPS
    assert any(f"late_start={STEPS} is at or past the trainer's max_steps={STEPS}" in m
               for m in said), said
    assert _callback(trainer).driver.controller.stage == "early"


def test_a_run_limited_by_max_epochs_alone_lands_its_late_stage(tmp_path):
    """Without late_steps, the late stage takes the rest of the epochs' steps (it used to stop
    the run with "max_steps (None) leaves no late steps")."""
    module = Regression()
    trainer = _trainer(tmp_path, {"max_epochs": STEPS})
    trainer.fit(module, _data())
    controller = _callback(trainer).driver.controller
    assert controller.stage == "late" and controller.steps == STEPS
    assert comera.compression_ratio(module, only=comera.GatedLayer) >= 0.95 * TARGET


def test_an_unreachable_target_is_a_warning_when_training_begins_and_when_it_ends(tmp_path):
    """Issue 34, item 6: 1000x is beyond the layer's rank-1 floor: said up front, and the end
    names the compression reached."""
    trainer = _trainer(tmp_path, target_compression=1000)
    with pytest.warns(UserWarning) as seen:
        trainer.fit(Regression(), _data())
    said = [str(w.message) for w in seen]
    assert any("target_compression=1000 is beyond reach" in m for m in said), said
    assert any("short of target_compression=1000" in m for m in said), said


def test_resuming_with_another_target_after_the_late_stage_began_is_refused(run, tmp_path):
    """Issue 34, item 7: epoch=3 (step 4) is in the late stage aimed at 4x: asking for 8x on
    resume is refused, naming the saved and the new value."""
    with pytest.raises(comera.ConfigError, match=r"target_compression 4\.0 -> 8"):
        _trainer(tmp_path, target_compression=8).fit(
            Regression(seed=1), _data(), ckpt_path=str(run["out"] / "epoch=3.ckpt"))


def test_resuming_with_another_late_start_before_the_late_stage_applies_it_and_says_so(
        run, tmp_path):
    """Issue 34, item 7: epoch=0 (step 1) is in the early stage: the new late_start applies,
    and a warning names the change."""
    trainer = _trainer(tmp_path, late_start=5)
    with pytest.warns(UserWarning, match="late_start 3 -> 5.*the new values apply"):
        trainer.fit(Regression(seed=1), _data(), ckpt_path=str(run["out"] / "epoch=0.ckpt"))
    controller = _callback(trainer).driver.controller
    assert controller.stage == "late" and controller.late_start[0] == 5


def test_resume_from_a_truncated_checkpoint_is_exact(run):
    """A fresh module (other random weights, untruncated) resumes after step 4 (the truncation
    was at step 3) and ends where the first run ended, bit for bit."""
    fresh = Regression(seed=1)
    trainer = _trainer(run["out"] / "again")
    trainer.fit(fresh, _data(), ckpt_path=str(run["out"] / "epoch=3.ckpt"))
    ref, got = run["module"].state_dict(), fresh.state_dict()
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), key


def test_load_from_checkpoint_refuses_the_truncated_weights(run):
    with pytest.raises(RuntimeError, match="size mismatch"):
        Regression.load_from_checkpoint(run["out"] / "epoch=7.ckpt")


def test_a_module_without_tt_layers_is_refused(tmp_path):
    class Dense(Regression):
        def __init__(self):
            pl.LightningModule.__init__(self)
            self.net = nn.Linear(16, 4)

    with pytest.raises(comera.ConfigError, match="no TT layers"):
        _trainer(tmp_path).fit(Dense(), _data())
