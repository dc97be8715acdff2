"""A size-aware early stage: the rank regulariser stops at a target size instead of collapsing.

    from comera.training.early import EarlyStage
    early = EarlyStage.for_compression(model, 40)             # TT layers 40x below dense
    trainer = comera.CoMERATrainer(model, opt, lam=0.5, early=early)

The plain early stage minimises ``L + lam * R`` at a fixed ``lam``: under Adam every gate moves
at about the gates' learning rate whatever ``lam`` is, so the size falls until the loss pushes
back, and where that is (9x after 300 steps at lam 0.05 on the reviews task, 57x-142x with a
larger lam over 450 steps) depends on ``lam``, the step count and the seed. With an
:class:`EarlyStage` the controller weights ``R`` only while the model is above
``target_size``: at the target ``lam`` is 0 (the loss alone trains the gates that are left),
and no step prunes the model below the target (entries that cross tau in that step are put
back, largest first, as the late stage does), so the stage ends at the size asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from comera.errors import ConfigError
from comera.layers.linear import GatedTrain
from comera.ranks.size import model_size, tt_modules

__all__ = ["EarlyStage"]


@dataclass(frozen=True)
class EarlyStage:
    """The early stage's size target S* in parameters (the whole model, TT layers at their
    effective ranks)."""

    target_size: float

    def __post_init__(self) -> None:
        if isinstance(self.target_size, bool) or not isinstance(self.target_size, int | float) \
                or not (math.isfinite(self.target_size) and self.target_size > 0):
            raise ConfigError(f"target_size={self.target_size!r}; it must be a finite number "
                              "> 0 of parameters.")

    @classmethod
    def for_compression(cls, model: nn.Module, ratio: float) -> EarlyStage:
        """A target with the TT layers ``ratio`` times below their dense size, the parameters
        outside them kept as they are."""
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not (
                math.isfinite(ratio) and ratio > 1):
            raise ConfigError(f"ratio={ratio!r}; the target is a finite number > 1 (TT layers' "
                              "dense size / their size).")
        layers = [m for _, m in tt_modules(model)]
        if not layers:
            raise ConfigError("the model has no TT layers: convert it with comera.convert_ "
                              "first.")
        outside = model_size(model) - model_size(model, only=GatedTrain)
        return cls(sum(m.dense_num_parameters() for m in layers) / ratio + outside)

    def lam(self, lam: float, size: float) -> float:
        """The regulariser weight for a step that starts at ``size``: ``lam`` above the
        target, 0 at or below it."""
        return lam if size > self.target_size else 0.0
