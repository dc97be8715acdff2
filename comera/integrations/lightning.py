"""CoMERA rank adaptation inside ``lightning.Trainer`` (the ``lightning`` extra).

    comera.convert_(module.net, ranks=16)                 # the LightningModule's network
    callback = CoMERACallback(target_compression=10, late_start=300)
    lightning.Trainer(max_steps=600, callbacks=[callback]).fit(module, data)

The same schedule as :mod:`comera.integrations.hf` (see :mod:`comera.integrations.stage_callback`):
the penalty reaches the gradients in ``on_before_optimizer_step`` (after gradient accumulation,
before clipping), the controller's bookkeeping runs after each optimizer step, and the late
stage truncates (with the optimizer state) and lands on the compression target. The module logs
its own loss; the callback logs ``comera/objective``, ``comera/size``, ``comera/compression``
(the TT layers', which ``target_compression`` refers to), ``comera/model_compression`` (the
whole model's), ``comera/rank_total`` and ``comera/late_stage``. A target the run cannot reach
is a warning (when training begins if it is known then, else when it ends; the run's steps are
``max_steps``, or what ``max_epochs`` come to when only epochs limit it); resuming with
changed settings is refused after the late stage began and warned about before. Checkpoints
keep the TT layers; ``fit(..., ckpt_path=...)`` resumes a truncated model exactly (the
controller's state and the settings are the callback's state), while
``LightningModule.load_from_checkpoint`` builds the module from its arguments and refuses the
truncated weights (strict loading) rather than loading part of them. One optimizer.
"""

from __future__ import annotations

import math
from typing import Any

from comera.errors import ConfigError
from comera.integrations.bonds import follow_saved_bonds_
from comera.integrations.stage_callback import StageCallback, has_tt_layers

try:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
except ImportError as exc:  # pragma: no cover - the lightning extra is missing
    raise ImportError("comera.integrations.lightning needs lightning: pip install -e "
                      "'.[lightning]' in the comera checkout.") from exc

__all__ = ["CoMERACallback"]


def _total_steps(trainer: Any) -> int | None:
    """The optimizer steps ``trainer``'s run ends at: ``max_steps``, or what ``max_epochs``
    (and the batches per epoch, gradient accumulation, ``limit_train_batches``) come to when
    only epochs limit it; None when unknown (an endless run, a loader without a length, an
    accumulation that changes between epochs)."""
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return int(trainer.max_steps)
    try:
        estimated = trainer.estimated_stepping_batches  # Lightning's own count of the steps
    except MisconfigurationException:  # e.g. accumulation that changes between epochs
        return None
    if isinstance(estimated, int | float) and math.isfinite(estimated) and estimated >= 1:
        return int(estimated)
    return None


class CoMERACallback(StageCallback, pl.Callback):
    """Rank-adaptive training in ``lightning.Trainer``; the arguments are those of
    :class:`~comera.integrations.stage_callback.StageSchedule`."""

    _saved: dict[str, Any] | None = None  # a checkpoint's state, until training starts

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Refuse a module without TT layers; make its layers take saved bonds on load."""
        if not has_tt_layers(pl_module):
            raise ConfigError("CoMERACallback: the LightningModule has no TT layers; convert it "
                              "with comera.convert_(module, ...) before fit.")
        follow_saved_bonds_(pl_module)  # fit(ckpt_path=...) loads truncated layers

    def on_train_start(self, trainer, pl_module) -> None:
        """Build the driver, restoring (and checking) a resumed run's state and settings."""
        if len(trainer.optimizers) != 1:
            raise ConfigError(f"CoMERACallback drives one optimizer; configure_optimizers "
                              f"returned {len(trainer.optimizers)}.")
        saved = self._saved or {}
        self.begin_training(pl_module, trainer.optimizers[0], _total_steps(trainer),
                            trainer.global_step, saved.get("controller"), saved.get("settings"))

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        """Remember the micro-batch's plain loss (the late stage decides on it)."""
        self.driver.saw_loss(loss)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        """Add the stage's penalty to the accumulated gradients."""
        self.driver.before_optimizer_step()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """The controller's bookkeeping after the optimizer step, then the ``comera/*`` metrics."""
        before = self.driver.controller.stage
        self.driver.after_optimizer_step(trainer.global_step, trainer.optimizers[0])
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        plain = float(loss.detach()) if loss is not None and hasattr(loss, "detach") else None
        values = self.driver.log_values(plain)
        pl_module.log_dict({f"comera/{k}": v for k, v in values.items()}, on_step=True,
                           on_epoch=False, batch_size=1)
        if before != self.driver.controller.stage:
            pl_module.log("comera/late_start_step", float(trainer.global_step), batch_size=1)

    def on_train_end(self, trainer, pl_module) -> None:
        """Warn when the run ended short of its target."""
        self.end_training(trainer.global_step)

    def state_dict(self) -> dict[str, Any]:
        """The controller's state and the schedule's settings, saved in Lightning checkpoints."""
        if self.driver is None:
            return {}
        return {"controller": self.driver.controller.state_dict(),
                "settings": self.schedule.settings()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep a checkpoint's state for :meth:`on_train_start`, which checks and restores it."""
        self._saved = dict(state_dict)
