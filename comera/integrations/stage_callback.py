"""What the trainer callbacks share: the stage schedule, the steps around the optimizer, and
:class:`StageCallback`, the part of both callbacks that does not depend on the trainer.

A callback cannot change the loss its trainer backpropagates, so it adds the controller's
:meth:`~comera.training.controller.RankController.penalty` (``lam * R`` early, the size term late)
to the gradients just before the optimizer step: gradients add, so the step equals one on
``loss + penalty``. The trainer keeps logging the plain loss; the callback logs the objective
(that loss plus the mean penalty over the same steps) next to it, with the size, the total
effective rank, ``compression`` (the gated layers' dense size over their size: what
``target_compression`` refers to) and ``model_compression`` (the same for the whole model,
every parameter outside the gated layers counted as it is).

What a user would otherwise learn only from the numbers is said as a warning: a target the run
cannot reach (known when training begins: ``late_start`` at or past the trainer's ``max_steps``,
fewer late steps than ``late_steps``, a target beyond the ``min_rank`` floor; or when it ends
short of the target). A resumed run compares the callback's settings with those saved in the
checkpoint: before the late stage began the new ones apply (a warning names them); after it
began, a changed setting of the late stage is refused, since that stage's target was fixed when
it started.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from comera.errors import ConfigError
from comera.layers.linear import GatedLayer
from comera.ranks.objective import REGULARIZERS, floor_size
from comera.ranks.size import compression_ratio, gated_layers, model_size
from comera.training.controller import RankController, late_stage_for

__all__ = ["StageCallback", "StageDriver", "StageSchedule"]

LANDED = 0.95  # a late stage that ends at less than this fraction of its target missed it
# the settings that decide the late stage: fixed once it has begun
LATE_SETTINGS = ("target_compression", "late_start", "late_steps", "target_loss", "min_rank")


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

    def settings(self) -> dict[str, Any]:
        """The schedule as plain data (what a checkpoint keeps, and a callback's arguments)."""
        return asdict(self)

    def changes(self, saved: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
        """The settings that differ from ``saved`` (a :meth:`settings` of an earlier run), as
        ``{name: (saved value, this value)}``; names ``saved`` lacks are not compared."""
        mine = self.settings()
        return {f.name: (saved[f.name], mine[f.name]) for f in fields(self)
                if f.name in saved and saved[f.name] != mine[f.name]}


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
        no_steps_left = self.max_steps is not None and step >= self.max_steps  # warned at start
        if (s.target_compression is not None and self.controller.stage == "early"
                and step >= s.late_start and not no_steps_left):
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
        since the last log), the size (every parameter, the gated layers at their effective
        ranks), ``compression`` (the gated layers': what ``target_compression`` refers to),
        ``model_compression`` (the whole model's), the total effective rank and whether the
        late stage runs."""
        stats = self.controller.stats()
        out = {"size": float(stats["size"]),
               "compression": float(stats["compression"]),
               "model_compression": float(stats["model_compression"]),
               "rank_total": float(sum(sum(r) for r in stats["ranks"].values())),
               "late_stage": float(stats["stage"] == "late")}
        if plain_loss is not None and self._penalties:
            out["objective"] = plain_loss + sum(self._penalties) / len(self._penalties)
        self._penalties.clear()
        return out


def has_tt_layers(model: nn.Module) -> bool:
    """Whether ``model`` holds a TT layer (the callbacks refuse a model without one)."""
    return any(True for _ in gated_layers(model))


def floor_compression(model: nn.Module, min_rank: int) -> float:
    """The gated layers' compression with every bond pruned to ``min_rank`` (the most the
    stages can reach; infinite when ``min_rank`` is 0, which may remove a layer)."""
    if min_rank == 0:
        return math.inf
    outside = model_size(model) - model_size(model, only=GatedLayer)  # hot rows count inside
    dense = sum(m.dense_num_parameters() for _, m in gated_layers(model))
    return dense / max(floor_size(model, min_rank) - outside, 1)


def _listed(changes: Mapping[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{name} {old!r} -> {new!r}" for name, (old, new) in changes.items())


class StageCallback:
    """The trainer-independent part of the HuggingFace and Lightning ``CoMERACallback``: its
    arguments (those of :class:`StageSchedule`), the driver it builds when training begins
    (restoring and checking a resumed run's state) and the warnings it gives when a target is
    out of reach. The trainer's hooks call :meth:`begin_training` and :meth:`end_training`."""

    def __init__(self, target_compression: float | None = None, late_start: int | None = None,
                 late_steps: int | None = None, lam: float = 0.01, regularizer: str = "l1",
                 min_rank: int = 1, target_loss: float | None = None):
        self.schedule = StageSchedule(target_compression, late_start, late_steps, lam,
                                      regularizer, min_rank, target_loss)
        self.driver: StageDriver | None = None

    def begin_training(self, model: nn.Module, optimizer: Any, max_steps: int | None,
                       step: int, controller: Mapping[str, Any] | None = None,
                       settings: Mapping[str, Any] | None = None) -> StageDriver:
        """Build the driver for a run that is at optimizer step ``step`` of ``max_steps``
        (None: unknown). A resumed run passes the controller state and the schedule settings
        its checkpoint saved: settings changed since are applied before the late stage began
        (with a warning naming them) and refused after (a :class:`ConfigError`)."""
        self.driver = StageDriver(self.schedule, model, optimizer, max_steps)
        who = type(self).__name__
        if controller is not None and step > 0:
            changes = self.schedule.changes(settings or {})
            fixed = {k: v for k, v in changes.items() if k in LATE_SETTINGS}
            if controller.get("stage") == "late" and fixed:
                raise ConfigError(
                    f"{who}: resuming at step {step}, after the late stage began, with settings "
                    f"other than those it began with ({_listed(fixed)}); the late stage's "
                    "target and schedule were fixed when it started. Resume with the saved "
                    "settings, or start a new run from the model.")
            self.driver.controller.load_state_dict(dict(controller))
            if changes:
                self.driver.controller.lam = self.schedule.lam
                self.driver.controller.min_rank = self.schedule.min_rank
                later = ("the late stage has not begun, so the new values apply"
                         if controller.get("stage") != "late"
                         else "they belong to the early stage, which is over")
                warnings.warn(f"{who}: resuming at step {step} with settings changed since the "
                              f"checkpoint ({_listed(changes)}); {later}.", UserWarning,
                              stacklevel=3)
        for problem in self._out_of_reach(model, max_steps, step):
            warnings.warn(f"{who}: {problem}", UserWarning, stacklevel=3)
        return self.driver

    def _out_of_reach(self, model: nn.Module, max_steps: int | None, step: int) -> list[str]:
        """Why the schedule's target cannot be reached, as far as is known before training."""
        s = self.schedule
        if s.target_compression is None or self.driver.controller.stage == "late":
            return []
        problems = []
        if max_steps is not None and s.late_start >= max_steps:
            problems.append(f"late_start={s.late_start} is at or past the trainer's max_steps="
                            f"{max_steps}, so the late stage never runs and target_compression="
                            f"{s.target_compression:g} is not reached; set late_start below "
                            f"{max_steps}.")
        elif (max_steps is not None and s.late_steps is not None
              and max_steps - s.late_start < s.late_steps):
            problems.append(f"the late stage gets {max_steps - s.late_start} steps (max_steps="
                            f"{max_steps} - late_start={s.late_start}), fewer than late_steps="
                            f"{s.late_steps}: it ends before landing on target_compression="
                            f"{s.target_compression:g}; lower late_steps or late_start.")
        reach = floor_compression(model, s.min_rank)
        if reach < LANDED * s.target_compression:
            problems.append(f"target_compression={s.target_compression:g} is beyond reach: with "
                            f"every bond at min_rank={s.min_rank} the gated layers compress "
                            f"{reach:.2f}x; lower the target (or min_rank, or convert at other "
                            "modes or formats).")
        return problems

    def end_training(self, step: int) -> str | None:
        """Warn (and return the message) when the run ends at optimizer step ``step`` short of
        its target: the late stage never began, or it ended below the target compression."""
        s = self.schedule
        if s.target_compression is None or self.driver is None:
            return None
        controller = self.driver.controller
        reached = compression_ratio(controller.model, only=GatedLayer)
        if controller.stage != "late":
            why = (f"the late stage never began (late_start={s.late_start}, training ended "
                   f"after step {step}): the gated layers end at {reached:.2f}x, not "
                   f"target_compression={s.target_compression:g}; set late_start below the "
                   "trainer's last step.")
        elif reached < LANDED * s.target_compression:
            why = (f"the late stage ended at {reached:.2f}x, short of target_compression="
                   f"{s.target_compression:g} (the gated layers' dense size over their size); "
                   f"{controller.late_note or 'give it more late steps (late_steps)'}.")
        else:
            return None
        warnings.warn(f"{type(self).__name__}: {why}", UserWarning, stacklevel=3)
        return why
