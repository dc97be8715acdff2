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


def _trainer(out) -> pl.Trainer:
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=out, every_n_epochs=1, save_top_k=-1,
                                               filename="{epoch}")
    return pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[CoMERACallback(TARGET, LATE_START), checkpoints])


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
