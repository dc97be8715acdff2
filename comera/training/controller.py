"""Rank adaptation any training loop can call: the CoMERA stages around the optimizer step.

    controller = comera.RankController(model, optimizer, lam=0.01)
    for batch in data:
        loss = loss_fn(model, batch)
        controller.loss(loss).backward()        # the stage's objective (L + lam * R early)
        optimizer.step(); optimizer.zero_grad()
        controller.after_step(optimizer)        # pruned gates stay pruned; late: land on S*
    controller.start_late_stage(comera.late_stage_for(model, compression=10, steps=300))

``loss(loss)`` returns the scalar to backpropagate and remembers the gates as they were before
the step; ``after_step(optimizer)`` keeps what the step pruned pruned (and the optimizer's
moments there cleared), holds the ``min_rank`` floor and, in the late stage, the size target and
its step-budget schedule. A loop that cannot change its loss (HuggingFace ``Trainer``, a Lightning
callback) calls :meth:`RankController.penalty` before the optimizer step and backpropagates that
alone: gradients add, so the step is the same. ``stats()`` says what the last step did.
:class:`~comera.training.trainers.CoMERATrainer` is this controller plus backward, checks and the
optimizer step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from comera.errors import ConfigError, NonFiniteLossError
from comera.layers.linear import GatedLayer
from comera.lean.readback import any_true, count_true
from comera.numbers import is_int
from comera.ranks.budget import check_ratio
from comera.ranks.objective import (
    REGULARIZERS,
    LateStage,
    floor_size,
    prune_to_,
    rank_regularizer,
    soft_size,
)
from comera.ranks.size import compression_ratio, dense_size, gated_layers, model_size
from comera.ranks.truncate import TruncationReport, truncate_
from comera.training.early import EarlyStage

log = logging.getLogger("comera.training.controller")

__all__ = ["RankController", "StepStats", "clear_moments_", "late_stage_for", "torch_optimizer"]


@dataclass(frozen=True)
class StepStats:
    """What one trainer step did: the loss, the objective it minimised, the stage, which term
    was weighted, and the model's size (every parameter, the gated layers at their effective
    ranks) after the step, with two ratios: ``compression``, the gated layers' dense size over
    their size (what a late stage's target compression and the callbacks' ``compression``
    mean), and ``model_compression``, the same for the whole model (every parameter outside
    the gated layers counted as it is). Late stage: ``scheduled_size`` is the size the step
    budget asks for after this step (S* without a budget), and ``note`` says, while the size is
    above it, why ("no step budget ...", "unreachable ...")."""

    loss: float
    objective: float
    stage: str  # "early" / "late" (CoMERA) or "dense"
    weighted: str  # "loss+rank" (early), "loss" / "size" (late), "loss" (dense)
    size: int
    compression: float  # the gated layers' (1.0 without any)
    scheduled_size: float | None = None
    note: str = ""
    model_compression: float = 1.0  # the whole model's


def torch_optimizer(optimizer: Any) -> Any:
    """The optimizer inside a wrapper (accelerate's ``AcceleratedOptimizer``, Lightning's
    ``LightningOptimizer``), whose state the controller edits: anything with ``param_groups``
    and a ``state`` mapping, as ``torch.optim.Optimizer`` has."""
    seen = optimizer
    for _ in range(4):
        inner = getattr(seen, "optimizer", None) or getattr(seen, "_optimizer", None)
        if inner is None or inner is seen or not hasattr(inner, "param_groups"):
            break
        seen = inner
    if not (hasattr(seen, "param_groups") and hasattr(seen, "state")):
        raise ConfigError(f"optimizer {type(optimizer).__name__}: expected a torch.optim."
                          "Optimizer (or a wrapper holding one as .optimizer).")
    return seen


def clear_moments_(optimizer: Any,
                   entries: Iterable[tuple[Tensor, Any]]) -> None:
    """Zero the optimizer's per-entry state (Adam's moments) of each ``(gate, index)`` pair;
    ``index`` is anything that indexes the gate (an int, a bool mask). State tensors shaped
    otherwise (Adam's step count) are left alone."""
    if optimizer is None:
        return
    with torch.no_grad():
        for gate, index in entries:
            for moment in optimizer.state.get(gate, {}).values():
                if isinstance(moment, Tensor) and moment.shape == gate.shape:
                    moment[index] = 0.0


def late_stage_for(model: nn.Module, compression: float, steps: int | None = None,
                   target_loss: float = 0.0, rounding: bool = True) -> LateStage:
    """A late stage whose TT layers end at ``compression`` times below their dense size (the
    parameters outside them kept as they are), landing within ``steps`` steps: the name loops
    call it by, for :meth:`LateStage.for_compression` over every gated layer."""
    return LateStage.for_compression(model, check_ratio(compression, "compression"),
                                     target_loss=target_loss, steps=steps, rounding=rounding)


@dataclass
class _Snapshot:
    """The gates as they were before an optimizer step (tiny vectors)."""

    late: bool
    pruned: list[tuple[Tensor, Tensor]]  # (gate, mask of entries already pruned)
    before: list[Tensor]


class RankController:
    """The CoMERA objective and the gate bookkeeping around one optimizer step.

    Early stage: ``loss(L)`` is ``L + lam * R`` (R: :func:`~comera.ranks.objective.
    rank_regularizer`). Late stage (:meth:`start_late_stage`, truncating the pruned ranks
    first): ``loss(L)`` weights the loss or the size, whichever is further from its target, and
    after each step the size follows the stage's step budget down to S* (see
    :class:`~comera.ranks.objective.LateStage`).

    ``min_rank`` (default 1) is a floor on every bond of every TT layer, in both stages: a step
    that would leave a gate with fewer than ``min_rank`` entries above tau keeps the largest of
    the entries it pruned at their previous values, and the late stage's schedule never prunes
    below it. So no layer is pruned to nothing (a TT token table at rank 0 would map every token
    to the same vector). ``min_rank=0`` allows removing a layer entirely (its weight is then
    exactly zero). A late-stage target below the floor's size is reported when the stage starts
    and in every step's ``note``.

    ``early`` (optional): an :class:`~comera.training.early.EarlyStage` size target; the early
    stage then weights R only while the model is above it and no step prunes below it, so the
    stage stops at that size instead of wherever lam and the step count leave it.

    ``optimizer`` (optional here, or given to each :meth:`after_step`) is the one whose state is
    cleared where gates are pruned and sliced at truncation.
    """

    def __init__(self, model: nn.Module, optimizer: Any = None, lam: float = 0.01,
                 regularizer: str = "l1", min_rank: int = 1, early: EarlyStage | None = None):
        if not any(True for _ in gated_layers(model)):
            raise ConfigError("the model has no TT layers: convert it with comera.convert_ first.")
        if isinstance(lam, bool) or not isinstance(lam, int | float) or not (
                lam >= 0 and math.isfinite(lam)):
            raise ConfigError(f"lam={lam!r}; the rank-regulariser weight is a finite number >= 0.")
        if regularizer not in REGULARIZERS:
            raise ConfigError(f"regularizer {regularizer!r}; choose one of "
                              f"{', '.join(REGULARIZERS)}.")
        if not is_int(min_rank, 0):
            raise ConfigError(f"min_rank={min_rank!r}; the rank floor is an int >= 0 (default 1; "
                              "0 lets a layer be pruned away).")
        if early is not None and not isinstance(early, EarlyStage):
            raise ConfigError(f"early={early!r}; give a comera.training.early.EarlyStage (e.g. "
                              "EarlyStage.for_compression(model, 40)) or None.")
        self.model = model
        self.early = early
        self._size: int | None = None  # the model's size after the last step
        # the size when training began (None: unknown, a state saved before it was kept): a late
        # stage that starts under its target says whether training or the model put it there
        self.start_size: float | None = float(model_size(model))
        self.early_start: float | None = None  # early target: the size at its first step
        self.early_scale = 1.0  # early target: lam's current multiplier
        self.optimizer = None if optimizer is None else torch_optimizer(optimizer)
        self.lam = lam
        self.regularizer = regularizer
        self.min_rank = min_rank
        self.stage = "early"
        self.late: LateStage | None = None
        self.steps = 0
        self.size_reference: float | None = None
        self.late_start: tuple[int, float] | None = None  # (step, size) at the stage's start
        self.late_note = ""
        self._snapshot: _Snapshot | None = None
        self._seen: tuple[float, float, str] | None = None  # loss, objective, weighted
        self._last: StepStats | None = None

    # -- before the optimizer step ---------------------------------------------------------------
    def objective(self, loss: Tensor, decision_loss: float | None = None) -> tuple[Tensor, str]:
        """The scalar to minimise for this step, and which term was weighted (no bookkeeping)."""
        if self.stage == "early":
            lam = self.lam
            if self.early is not None:
                size = model_size(self.model) if self._size is None else self._size
                if self.early_start is None:
                    self.early_start = float(size)
                lam = self.early.lam(lam * self.early_scale, size)
            if lam == 0:
                return loss, "loss"
            return loss + lam * rank_regularizer(self.model, self.regularizer), "loss+rank"
        return self.late.objective(self.model, loss, self.size_reference, decision_loss)

    def loss(self, loss: Tensor, decision_loss: float | None = None) -> Tensor:
        """The objective to backpropagate for ``loss`` (raises :class:`NonFiniteLossError` on a
        NaN/inf loss). ``decision_loss``: the loss the late stage decides on (the all-worker mean
        under data parallelism; default ``loss``). Call it before the optimizer step (once per
        micro-batch under gradient accumulation)."""
        check_loss(loss, self.steps)
        total, which = self.objective(loss, decision_loss)
        self.before_step()
        self._seen = (float(loss.detach()), float(total.detach()), which)
        return total

    def penalty(self, decision_loss: float | None = None) -> Tensor | None:
        """What :meth:`loss` adds to the loss this step (None when nothing), for loops that
        cannot change their loss: backpropagate it before the optimizer step, after the loss's
        own backward. ``decision_loss``: the plain loss of this step (the late stage decides on
        it; without one a late stage above its target weights the size)."""
        seen = decision_loss
        if seen is None and self.late is not None:
            seen = self.late.target_loss
        zero = torch.zeros((), dtype=torch.float64)
        total, which = self.objective(zero, seen)
        self.before_step()
        extra = float(total.detach())
        loss = float("nan") if decision_loss is None else float(decision_loss)
        self._seen = (loss, loss + extra, which)
        return total if total.requires_grad else None

    def before_step(self) -> None:
        """Remember the gates before the optimizer step (:meth:`loss` and :meth:`penalty` call
        it; a loop calling neither calls it itself)."""
        layers = [layer for _, layer in gated_layers(self.model)]
        self._snapshot = _Snapshot(
            self.stage == "late",
            [(g, ~m) for layer in layers
             for g, m in zip(layer.gates, layer.gate_masks(), strict=True)],
            [g.detach().clone() for layer in layers for g in layer.gates])

    # -- after the optimizer step -----------------------------------------------------------------
    def after_step(self, optimizer: Any = None) -> StepStats:
        """Bookkeeping after ``optimizer.step()``: pruned gates stay pruned (their moments
        cleared), the ``min_rank`` floor holds, and in the late stage the size holds at S* and
        follows the step budget. Returns (and keeps, for :meth:`stats`) the step's stats."""
        snap = self._snapshot
        if snap is None:
            raise ConfigError("after_step without a step: call controller.loss(loss) (or "
                              "penalty() / before_step()) before the optimizer step.")
        opt = self.optimizer if optimizer is None else torch_optimizer(optimizer)
        layers = [layer for _, layer in gated_layers(self.model)]
        self._keep_pruned_(snap.pruned, opt)
        self.hold_floor_(snap.before, opt)
        scheduled, note = None, ""
        if snap.late:
            self._hold_size_target_(layers, snap.before, opt, self.late.target_size)
            scheduled = self.follow_schedule_(opt)
        elif self.early is not None:
            self._hold_size_target_(layers, snap.before, opt, self.early.target_size)
        size = model_size(self.model)
        if not snap.late and self.early is not None and self.early_start is not None:
            scheduled = self.early.scheduled_size(self.early_start, self.steps)
            with torch.no_grad():  # the soft size: ranks as the gates' l1 norms
                soft = float(soft_size(self.model)) + size - model_size(self.model,
                                                                        only=GatedLayer)
            self.early_scale = self.early.scale(self.early_scale, self.steps, self.early_start,
                                                size, soft)
        self.steps += 1
        self._size = size
        if snap.late and (size > self.late.target_size or self.late_note.startswith("below")):
            note = self.late_note
        loss, total, which = self._seen if self._seen is not None else (
            float("nan"), float("nan"), "")
        self._snapshot, self._seen = None, None
        gated, whole = self.compressions(size)
        self._last = StepStats(loss, total, "late" if snap.late else "early", which, size,
                               gated, scheduled, note, whole)
        return self._last

    def compressions(self, size: int | None = None) -> tuple[float, float]:
        """(the gated layers' compression, the whole model's) now: dense size over size, of
        the gated layers at their effective ranks (with their hot-row caches), and of every
        parameter. ``size``: the model's size, when already counted."""
        size = model_size(self.model) if size is None else size
        gated = compression_ratio(self.model, only=GatedLayer)
        return gated, dense_size(self.model) / max(size, 1)

    def discard_step(self) -> None:
        """Forget the step begun by :meth:`loss` (its optimizer step was not applied)."""
        self._snapshot, self._seen = None, None

    def _keep_pruned_(self, pruned, optimizer) -> None:
        """A pruned gate gets no gradient, but Adam's momentum would carry it back past tau:
        pin it at zero and clear its moments, so pruning is final."""
        with torch.no_grad():
            for (gate, off), some in zip(pruned, any_true([off for _, off in pruned]),
                                         strict=True):
                if not some:
                    continue
                gate[off] = 0.0
                clear_moments_(optimizer, [(gate, off)])

    def hold_floor_(self, before: list[Tensor], optimizer: Any = None) -> None:
        """The ``min_rank`` floor: a gate left with fewer than ``min_rank`` live entries by this
        step gets its largest just-pruned entries back at their previous values (and their
        moments cleared). ``before``: every gate's values before the step, one tensor per gate
        in :func:`~comera.ranks.size.gated_layers` order. :meth:`after_step` calls it; a step run
        outside the controller (:class:`~comera.training.capture.CapturedStep`) calls it after
        its optimizer step."""
        opt = self.optimizer if optimizer is None else torch_optimizer(optimizer)
        gates = [(layer, g) for _, layer in gated_layers(self.model) for g in layer.gates]
        if len(before) != len(gates):
            raise ConfigError(f"hold_floor_ got {len(before)} gate snapshots for {len(gates)} "
                              "gates: pass one tensor per gate, taken before the step.")
        with torch.no_grad():
            alives = [gate.detach().abs() > layer.tau for layer, gate in gates]
            for (layer, gate), old, alive, live in zip(gates, before, alives, count_true(alives),
                                                       strict=True):
                missing = self.min_rank - live
                if missing <= 0:
                    continue
                lost = (old.abs() > layer.tau) & ~alive
                order = sorted(lost.nonzero().flatten().tolist(),
                               key=lambda i, old=old: -float(old[i].abs()))
                back = order[:missing]
                for i in back:
                    gate[i] = old[i]
                clear_moments_(opt, [(gate, i) for i in back])

    def follow_schedule_(self, optimizer: Any = None) -> float | None:
        """Late stage: the size the step budget asks for after this step (S* without a budget),
        and with a budget, prune to it now (within 5% of S* below it; the pruned entries'
        moments cleared). None in the early stage. Call it after the optimizer step, before
        ``steps`` counts the step (:meth:`after_step` does)."""
        if self.stage != "late" or self.late is None:
            return None
        opt = self.optimizer if optimizer is None else torch_optimizer(optimizer)
        scheduled = self.late.scheduled_size(self.late_start[1], self.steps - self.late_start[0])
        if self.late.steps is not None:  # the budget's schedule; else the optimizer's pace
            lower = scheduled - 0.05 * self.late.target_size  # land within 5% of S*
            clear_moments_(opt, prune_to_(self.model, scheduled, self.min_rank, lower,
                                          self.late.rounding, opt))
        return scheduled

    def _hold_size_target_(self, layers, before: list[Tensor], optimizer,
                           target: float) -> None:
        """A step must not prune far below the size target (the late stage's, or the early
        stage's with an :class:`EarlyStage`). Adam moves every gate entry at about the same
        rate, so many cross tau in the same step; when that takes the model under ``target``,
        the entries pruned this step are restored to their previous values, largest first, as
        long as the size stays at or below it."""
        if model_size(self.model) >= target:
            return
        gates = [(layer, g) for layer in layers for g in layer.gates]
        candidates = []
        for (layer, gate), old in zip(gates, before, strict=True):
            crossed = (old.abs() > layer.tau) & (gate.detach().abs() <= layer.tau)
            for i in crossed.nonzero().flatten().tolist():
                candidates.append((float(old[i].abs()), gate, i, float(old[i])))
        with torch.no_grad():
            for _, gate, i, value in sorted(candidates, key=lambda c: -c[0]):
                pruned_value = float(gate[i])
                gate[i] = value
                if model_size(self.model) > target:  # one slice too many: keep it pruned
                    gate[i] = pruned_value
                    continue
                clear_moments_(optimizer, [(gate, i)])

    # -- stages -----------------------------------------------------------------------------------
    def start_late_stage(self, late: LateStage, truncate: bool = True,
                         optimizer: Any = None) -> TruncationReport | None:
        """Switch to the late stage: with ``late.allocation == "spectrum"`` fix the shape from
        the bonds' spectra first (:meth:`LateStage.allocate_`), then truncate the pruned ranks
        (by default, with the optimizer's state)."""
        if not isinstance(late, LateStage):
            raise ConfigError(f"start_late_stage takes a comera.LateStage, got {late!r}.")
        opt = self.optimizer if optimizer is None else torch_optimizer(optimizer)
        allocated = late.allocate_(self.model, opt, self.min_rank)
        report = self.truncate(optimizer) if truncate else None
        self.stage = "late"
        self.late = late
        size = float(model_size(self.model))
        self.size_reference = size
        self.late_start = (self.steps, size)
        # a shape the spectrum allocation just fixed is the target's: nothing to warn about
        self.late_note = "" if allocated is not None else self._plan_note(late, size, optimizer)
        if self.late_note:
            log.warning("late stage: %s", self.late_note)
        return report

    def _plan_note(self, late: LateStage, size: float, optimizer: Any = None) -> str:
        """Why the late stage may not reach S* (empty when it will): said up front and in the
        step stats, never silently."""
        floor = floor_size(self.model, self.min_rank)
        if size < 0.95 * late.target_size:
            return self._below_note(late.target_size, size)
        if floor > late.target_size:
            return (f"unreachable: the target {late.target_size:.0f} parameters is below the "
                    f"min_rank={self.min_rank} floor of {floor} (lower min_rank or raise the "
                    "target)")
        if late.steps is None and size > late.target_size:
            opt = self.optimizer if optimizer is None else torch_optimizer(optimizer)
            groups = opt.param_groups if opt is not None else []
            lrs = [g["lr"] for g in groups if g.get("name") == "gates"]
            lr = lrs[0] if lrs else float("nan")
            tau = max((m.tau for _, m in gated_layers(self.model)), default=0.0)
            need = math.ceil((1.0 - tau) / lr) if lr > 0 else "many"
            return (f"no step budget: the size moves only as fast as the gates' learning rate "
                    f"(lr {lr:g}: ~{need} steps to carry a gate from 1 to tau); give LateStage "
                    "steps=N to land on the target in N steps")
        return ""

    def _below_note(self, target: float, size: float) -> str:
        """Why a late stage starts under its target ``target`` at ``size`` parameters (ranks
        are not grown back): the early stage pruned past it, or the model was past it before
        training (its conversion or build ranks), or, for a state saved without the size
        training began at, either."""
        start = self.start_size
        head = f"below: the stage starts at {size:.0f} parameters, under the target {target:.0f}"
        if start is None:
            return (f"{head} (pruned past it by the early stage, or built or converted at ranks "
                    "already past it), and ranks are not grown back")
        if start < 0.95 * target:
            pruned = (f"the early stage pruned {start - size:.0f} more" if start > size
                      else "nothing was pruned")
            return (f"{head}: the model was under it before training, at {start:.0f} "
                    f"parameters (its ranks compress past the target already; {pruned}), and "
                    "ranks are not grown back; convert or build it at higher ranks, or aim at "
                    "a higher compression")
        return (f"{head} (the early stage pruned past it from {start:.0f}, and ranks are not "
                "grown back); lower lam or the early steps to land on the target")

    def truncate(self, optimizer: Any = None) -> TruncationReport:
        """Remove pruned ranks now (model and optimizer state)."""
        opt = self.optimizer if optimizer is None else torch_optimizer(optimizer)
        return truncate_(self.model, opt)

    # -- reading and saving -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Plain numbers for a logger: the last step's loss and objective, the stage, the step
        count, the model's size now, ``compression`` (the gated layers' dense size over their
        size: what the late stage's target compression means), ``model_compression`` (the
        whole model's) and each gated layer's effective ranks."""
        size = model_size(self.model)
        gated, whole = self.compressions(size)
        last = self._last
        out: dict[str, Any] = {
            "stage": self.stage, "steps": self.steps,
            "loss": last.loss if last else float("nan"),
            "objective": last.objective if last else float("nan"),
            "weighted": last.weighted if last else "",
            "size": size, "compression": gated, "model_compression": whole,
            "ranks": {name: list(m.bond_ranks) for name, m in gated_layers(self.model)},
        }
        if last is not None and last.scheduled_size is not None:
            out["scheduled_size"] = last.scheduled_size
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint: stage, step count, late-stage targets."""
        late = None if self.late is None else {
            "target_size": self.late.target_size, "target_loss": self.late.target_loss,
            "size_weight": self.late.size_weight, "steps": self.late.steps,
            "landing": self.late.landing, "rounding": self.late.rounding,
            "allocation": self.late.allocation, "floor": self.late.floor}
        return {"stage": self.stage, "steps": self.steps, "late": late,
                "early": None if self.early is None else {
                    "target_size": self.early.target_size, "steps": self.early.steps,
                    "landing": self.early.landing, "gain": self.early.gain},
                "early_start": self.early_start, "early_scale": self.early_scale,
                "size_reference": self.size_reference, "lam": self.lam,
                "late_start": None if self.late_start is None else list(self.late_start),
                "late_note": self.late_note, "min_rank": self.min_rank,
                "start_size": self.start_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore stage, step count, late-stage targets and ``lam`` from :meth:`state_dict`'s data
        (a :class:`ConfigError` for a state not saved by a controller or a CoMERATrainer)."""
        if not isinstance(state, dict) or state.get("stage") not in ("early", "late"):
            stage = state.get("stage") if isinstance(state, dict) else state
            raise ConfigError(f"trainer state has stage {stage!r}; expected "
                              "'early' or 'late' (was it saved by a CoMERATrainer?).")
        self.stage = state["stage"]
        self.steps = int(state["steps"])
        self.late = None if state["late"] is None else LateStage(**state["late"])
        self.size_reference = state["size_reference"]
        self.lam = float(state.get("lam", self.lam))
        if state.get("early") is not None:
            self.early = EarlyStage(**state["early"])
        self.early_start = state.get("early_start")
        self.early_scale = float(state.get("early_scale", 1.0))
        self._size = None
        start = state.get("late_start")
        if start is None and self.late is not None:  # saved before step budgets existed
            start = (self.steps, self.size_reference or 0.0)
        self.late_start = None if start is None else (int(start[0]), float(start[1]))
        self.late_note = str(state.get("late_note", ""))
        self.min_rank = int(state.get("min_rank", self.min_rank))
        start_size = state.get("start_size")  # absent from states saved before it was kept
        self.start_size = None if start_size is None else float(start_size)


def check_loss(loss: Tensor, step: int) -> None:
    """Raise :class:`NonFiniteLossError` when ``loss`` holds a NaN or an infinity."""
    if not bool(torch.isfinite(loss.detach()).all()):
        raise NonFiniteLossError(
            f"step {step}: the loss is {float(loss.detach())}; the step was not applied "
            "(lower the learning rates, or restore the last checkpoint)."
        )
