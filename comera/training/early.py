"""A size-aware early stage: the rank regulariser stops at a target size instead of collapsing.

    from comera.training.early import EarlyStage
    early = EarlyStage.for_compression(model, 40, steps=450)  # TT layers 40x below dense
    trainer = comera.CoMERATrainer(model, opt, lam=0.05, early=early)

The plain early stage minimises ``L + lam * R`` at a fixed ``lam``: under Adam every gate moves
at about the gates' learning rate whatever ``lam`` is, so the size falls until the loss pushes
back, and where that is depends on ``lam``, the step count and the seed. With an
:class:`EarlyStage` the controller adapts ``lam`` toward the target: with a step budget
(``steps``) the size should follow a geometric schedule from where it starts to
``target_size`` over ``landing * steps`` steps, and after each step ``lam`` is multiplied by
``1 + gain`` while the size is above the schedule and divided by it while below (never below
the ``lam`` given), so a ``lam`` too small to prune corrects itself. Along the schedule the
size compared is the soft size (:func:`~comera.ranks.objective.soft_size`: each rank replaced
by its gate's l1 norm), which moves as soon as the gates do (the pruned size follows only when
they cross tau, ~1/lr_gates steps later); after it, the pruned size, so lam pushes on until
the gates that the soft size already counts small are pruned. At the
target ``lam`` is 0 (the loss alone trains the gates that are left), and no step prunes the
model below the target (entries that cross tau in that step are put back, largest first, as
the late stage does), so the stage ends at the size asked for, within one rank slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from comera.errors import ConfigError
from comera.ranks.budget import check_ratio, size_target

__all__ = ["EarlyStage"]


@dataclass(frozen=True)
class EarlyStage:
    """The early stage's size target S* in parameters (the whole model, TT layers at their
    effective ranks); ``steps``: the step budget whose first ``landing`` fraction the size
    schedule spans (None: no schedule, lam kept as given until S*); ``gain``: the factor
    (``1 + gain``) lam moves by per step toward the schedule."""

    target_size: float
    steps: int | None = None
    landing: float = 0.5
    gain: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.target_size, bool) or not isinstance(self.target_size, int | float) \
                or not (math.isfinite(self.target_size) and self.target_size > 0):
            raise ConfigError(f"target_size={self.target_size!r}; it must be a finite number "
                              "> 0 of parameters.")
        if self.steps is not None and (isinstance(self.steps, bool) or not isinstance(
                self.steps, int) or self.steps < 1):
            raise ConfigError(f"steps={self.steps!r}; give the early stage's step count (an int "
                              ">= 1) or None.")
        if not 0 < self.landing <= 1:
            raise ConfigError(f"landing={self.landing!r}; give a fraction in (0, 1].")
        if not (math.isfinite(self.gain) and self.gain >= 0):
            raise ConfigError(f"gain={self.gain!r}; give a finite number >= 0 (0: lam fixed).")

    @classmethod
    def for_compression(cls, model: nn.Module, ratio: float, steps: int | None = None,
                        landing: float = 0.5, gain: float = 0.1) -> EarlyStage:
        """A target with the TT layers ``ratio`` times below their dense size, the parameters
        outside them kept as they are (:func:`comera.ranks.budget.size_target`)."""
        return cls(size_target(model, check_ratio(ratio)), steps, landing, gain)

    def scheduled_size(self, start_size: float, step: int) -> float:
        """The size to be at after ``step`` steps (0-based): geometric from ``start_size`` to
        S* over ``landing * steps`` steps, then S* (S* at once without a budget)."""
        if self.steps is None or start_size <= self.target_size:
            return self.target_size
        span = max(1, math.floor(self.landing * self.steps))
        t = min(1.0, (step + 1) / span)
        return start_size * (self.target_size / start_size) ** t

    def scale(self, scale: float, step: int, start_size: float, size: float,
              soft: float) -> float:
        """The next multiplier of lam after step ``step`` (0-based) ended at ``size`` (soft
        size ``soft``): up by ``1 + gain`` above the schedule, down below it (kept in
        [1, 1e4]: never under the lam given; unchanged without a budget)."""
        if self.steps is None:
            return scale
        scheduled = self.scheduled_size(start_size, step)
        along = step + 1 < max(1, math.floor(self.landing * self.steps))
        factor = 1 + self.gain
        above = (soft if along else size) > scheduled
        return min(1e4, max(1.0, scale * factor if above else scale / factor))

    def lam(self, lam: float, size: float) -> float:
        """The regulariser weight for a step that starts at ``size``: ``lam`` above the
        target, 0 at or below it."""
        return lam if size > self.target_size else 0.0
