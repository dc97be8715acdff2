"""CoMERA rank adaptation inside ``lightning.Trainer`` (the ``lightning`` extra).

    comera.convert_(module.net, ranks=16)                 # the LightningModule's network
    callback = CoMERACallback(target_compression=10, late_start=300)
    lightning.Trainer(max_steps=600, callbacks=[callback]).fit(module, data)

The same schedule as :mod:`comera.integrations.hf` (see :mod:`comera.integrations.schedule`):
the penalty reaches the gradients in ``on_before_optimizer_step`` (after gradient accumulation,
before clipping), the controller's bookkeeping runs after each optimizer step, and the late
stage truncates (with the optimizer state) and lands on the compression target. The module logs
its own loss; the callback logs ``comera/objective``, ``comera/size``, ``comera/compression``,
``comera/rank_total`` and ``comera/late_stage``. Checkpoints keep the TT layers; ``fit(...,
ckpt_path=...)`` resumes a truncated model exactly (the controller's state is the callback's
state), while ``LightningModule.load_from_checkpoint`` builds the module from its arguments and
refuses the truncated weights (strict loading) rather than loading part of them. One optimizer.
"""

from __future__ import annotations

from typing import Any

from comera.errors import ConfigError
from comera.integrations.bonds import follow_saved_bonds_
from comera.integrations.schedule import StageDriver, StageSchedule, has_tt_layers

try:
    import lightning.pytorch as pl
except ImportError as exc:  # pragma: no cover - the lightning extra is missing
    raise ImportError("comera.integrations.lightning needs lightning: pip install "
                      "'tncomp[lightning]'.") from exc

__all__ = ["CoMERACallback"]


class CoMERACallback(pl.Callback):
    """Rank-adaptive training in ``lightning.Trainer``; the arguments are those of
    :class:`~comera.integrations.schedule.StageSchedule`."""

    def __init__(self, target_compression: float | None = None, late_start: int | None = None,
                 late_steps: int | None = None, lam: float = 0.01, regularizer: str = "l1",
                 min_rank: int = 1, target_loss: float | None = None):
        self.schedule = StageSchedule(target_compression, late_start, late_steps, lam,
                                      regularizer, min_rank, target_loss)
        self.driver: StageDriver | None = None
        self._saved: dict[str, Any] | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not has_tt_layers(pl_module):
            raise ConfigError("CoMERACallback: the LightningModule has no TT layers; convert it "
                              "with comera.convert_(module, ...) before fit.")
        follow_saved_bonds_(pl_module)  # fit(ckpt_path=...) loads truncated layers

    def on_train_start(self, trainer, pl_module) -> None:
        if len(trainer.optimizers) != 1:
            raise ConfigError(f"CoMERACallback drives one optimizer; configure_optimizers "
                              f"returned {len(trainer.optimizers)}.")
        max_steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        self.driver = StageDriver(self.schedule, pl_module, trainer.optimizers[0], max_steps)
        if self._saved is not None:
            self.driver.controller.load_state_dict(self._saved)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.driver.saw_loss(loss)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.driver.before_optimizer_step()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        before = self.driver.controller.stage
        self.driver.after_optimizer_step(trainer.global_step, trainer.optimizers[0])
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        plain = float(loss.detach()) if loss is not None and hasattr(loss, "detach") else None
        values = self.driver.log_values(plain)
        pl_module.log_dict({f"comera/{k}": v for k, v in values.items()}, on_step=True,
                           on_epoch=False, batch_size=1)
        if before != self.driver.controller.stage:
            pl_module.log("comera/late_start_step", float(trainer.global_step), batch_size=1)

    def state_dict(self) -> dict[str, Any]:
        """The controller's state, saved in Lightning checkpoints."""
        return {} if self.driver is None else {"controller": self.driver.controller.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved = state_dict.get("controller")
