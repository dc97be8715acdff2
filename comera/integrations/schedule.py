"""What the trainer callbacks share: the stage schedule and the steps around the optimizer.

A callback cannot change the loss its trainer backpropagates, so it adds the controller's
:meth:`~comera.training.controller.RankController.penalty` (``lam * R`` early, the size term late)
to the gradients just before the optimizer step: gradients add, so the step equals one on
``loss + penalty``. The trainer keeps logging the plain loss; the callback logs the objective
(that loss plus the mean penalty over the same steps) next to it, with the size, the compression
and the total effective rank.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from comera.errors import ConfigError
from comera.ranks.objective import REGULARIZERS
from comera.ranks.size import gated_layers
from comera.training.controller import RankController, late_stage_for

__all__ = ["StageDriver", "StageSchedule"]


def _is_number(value: object) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def _is_count(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


@dataclass(frozen=True)
class StageSchedule:
    """When and how the callbacks adapt ranks.

    ``lam`` / ``regularizer`` / ``min_rank``: the early stage (see
    :class:`~comera.training.controller.RankController`). ``target_compression``: the late
    stage's goal, the TT layers' dense size over their size (None: the early stage only);
    it starts after ``late_start`` optimizer steps (truncating the pruned ranks, with the
    optimizer state) and lands within ``late_steps`` steps (default: the rest of training).
    ``target_loss``: the late stage's loss target (default: the mean loss of the last 50 early
    steps).
    """

    target_compression: float | None = None
    late_start: int | None = None
    late_steps: int | None = None
    lam: float = 0.01
    regularizer: str = "l1"
    min_rank: int = 1
    target_loss: float | None = None

    def __post_init__(self) -> None:
        if self.target_compression is not None:
            if not (_is_number(self.target_compression) and self.target_compression > 1):
                raise ConfigError(f"target_compression={self.target_compression!r}; a finite "
                                  "number > 1 (dense size / TT size), or None for no late stage.")
            if not _is_count(self.late_start, 0):
                raise ConfigError(f"late_start={self.late_start!r}; with a target_compression, "
                                  "the optimizer step the late stage starts after (an int >= 0).")
        elif self.late_start is not None or self.late_steps is not None:
            raise ConfigError("late_start / late_steps without target_compression: set the "
                              "compression the late stage aims at, e.g. target_compression=10.")
        if self.late_steps is not None and not _is_count(self.late_steps, 1):
            raise ConfigError(f"late_steps={self.late_steps!r}; the late stage's step budget is "
                              "an int >= 1 (default: the rest of training).")
        if not (_is_number(self.lam) and self.lam >= 0):
            raise ConfigError(f"lam={self.lam!r}; the rank-regulariser weight is a finite "
                              "number >= 0.")
        if self.regularizer not in REGULARIZERS:
            raise ConfigError(f"regularizer={self.regularizer!r}; choose one of "
                              f"{', '.join(REGULARIZERS)}.")
        if not _is_count(self.min_rank, 0):
            raise ConfigError(f"min_rank={self.min_rank!r}; the rank floor is an int >= 0.")
        if self.target_loss is not None and not (_is_number(self.target_loss)
                                                 and self.target_loss >= 0):
            raise ConfigError(f"target_loss={self.target_loss!r}; a finite number >= 0, or None "
                              "for the early stage's recent mean loss.")


class StageDriver:
    """A :class:`RankController` driven from a trainer's hooks (one per training run)."""

    def __init__(self, schedule: StageSchedule, model: nn.Module, optimizer: Any,
                 max_steps: int | None = None):
        self.schedule = schedule
        self.controller = RankController(model, optimizer, schedule.lam, schedule.regularizer,
                                         schedule.min_rank)
        self.max_steps = max_steps
        self._losses: list[Tensor] = []  # micro-batch losses since the last optimizer step
        self._recent: deque[float] = deque(maxlen=50)  # step losses, for the loss target
        self._penalties: list[float] = []  # since the last log
        self._stepped = False

    def saw_loss(self, loss: Tensor) -> None:
        """A training micro-batch's plain loss (kept detached; read at the optimizer step)."""
        if isinstance(loss, Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach().reshape(()))

    def before_optimizer_step(self) -> None:
        """Add the stage's penalty to the accumulated gradients."""
        seen = None
        if self._losses:
            seen = float(torch.stack([v.float().cpu() for v in self._losses]).mean())
            self._recent.append(seen)
        self._losses.clear()
        penalty = self.controller.penalty(seen)
        if penalty is not None:
            penalty.backward()
            self._penalties.append(float(penalty.detach()))
        else:
            self._penalties.append(0.0)
        self._stepped = True

    def after_optimizer_step(self, step: int, optimizer: Any) -> None:
        """The controller's bookkeeping; the late stage starts after ``late_start`` steps."""
        if not self._stepped:
            return
        self._stepped = False
        self.controller.after_step(optimizer)
        s = self.schedule
        if (s.target_compression is not None and self.controller.stage == "early"
                and step >= s.late_start):
            self.start_late_stage(step, optimizer)

    def start_late_stage(self, step: int, optimizer: Any) -> None:
        """Truncate (with the optimizer state) and aim at the schedule's compression."""
        s = self.schedule
        steps = s.late_steps
        if steps is None:
            if self.max_steps is None or self.max_steps - step < 1:
                raise ConfigError(f"late_steps is unset and the trainer's max_steps "
                                  f"({self.max_steps}) leaves no late steps after step {step}; "
                                  "set late_steps=N.")
            steps = self.max_steps - step
        target_loss = s.target_loss
        if target_loss is None:
            target_loss = sum(self._recent) / len(self._recent) if self._recent else 0.0
        late = late_stage_for(self.controller.model, s.target_compression, steps, target_loss)
        self.controller.start_late_stage(late, optimizer=optimizer)

    def log_values(self, plain_loss: float | None = None) -> dict[str, float]:
        """Numbers for the trainer's log: the objective (``plain_loss`` plus the mean penalty
        since the last log), the size, the compression, the total effective rank and whether
        the late stage runs."""
        stats = self.controller.stats()
        out = {"size": float(stats["size"]), "compression": float(stats["compression"]),
               "rank_total": float(sum(sum(r) for r in stats["ranks"].values())),
               "late_stage": float(stats["stage"] == "late")}
        if plain_loss is not None and self._penalties:
            out["objective"] = plain_loss + sum(self._penalties) / len(self._penalties)
        self._penalties.clear()
        return out


def has_tt_layers(model: nn.Module) -> bool:
    """Whether ``model`` holds a TT layer (the callbacks refuse a model without one)."""
    return any(True for _ in gated_layers(model))
