"""Rank-adaptive training: optimizer groups and the two-stage CoMERA controller.

    opt = comera.make_optimizer(model)                 # cores / gates / rest, paper defaults
    trainer = comera.CoMERATrainer(model, opt)         # early stage: L + lam * R
    for batch in data:
        stats = trainer.step(loss_fn(model, batch))    # backward + optimizer step
    trainer.start_late_stage(comera.LateStage.from_ratio(model, 3.0, target_loss=0.3,
                                                         steps=300))
    ...                                                # late stage: lands on S* in 300 steps

The stage boundary truncates the pruned ranks physically (``truncate_``), which also slices the
optimizer state; the compiled plans re-plan for the new shapes on the next forward.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from comera.errors import ConfigError, NonFiniteGradientError, NonFiniteLossError
from comera.ranks.objective import REGULARIZERS, LateStage, floor_size, prune_to_, rank_regularizer
from comera.ranks.size import dense_size, model_size, tt_modules
from comera.ranks.truncate import TruncationReport, truncate_

log = logging.getLogger("comera.training.trainers")


def pick_threads(step: Callable[[], object], candidates: Sequence[int] | None = None,
                 repeats: int = 3) -> int:
    """Time ``step`` (e.g. one forward+backward) at each CPU thread count of ``candidates``
    (default: 1 and the current count), in alternation after one warm-up call each; set the
    fastest with ``torch.set_num_threads`` and return it.

    Why measure: the right count depends on the model and on the machine's load. A small TT
    model's step is a chain of thin GEMMs too small to split well, and on a busy 2-core machine
    2 threads made a small TT step 10x slower than 1 thread, while a large dense step gains
    from every core; no size rule found held across both, so the engine times a few steps."""
    current = torch.get_num_threads()
    candidates = sorted(set(candidates or (1, current)))
    if any(not isinstance(n, int) or n < 1 for n in candidates):
        raise ConfigError(f"thread counts {candidates}; each is an int >= 1.")
    times: dict[int, list[float]] = {n: [] for n in candidates}
    for n in candidates:
        torch.set_num_threads(n)
        step()
    for _ in range(repeats):
        for n in candidates:
            torch.set_num_threads(n)
            start = time.perf_counter()
            step()
            times[n].append(time.perf_counter() - start)
    best = min(candidates, key=lambda n: statistics.median(times[n]))
    torch.set_num_threads(best)
    log.info("threads: %s ms per step at %s threads; using %d",
             [round(statistics.median(times[n]) * 1e3, 2) for n in candidates], candidates, best)
    return best


@dataclass(frozen=True)
class OptimizerConfig:
    """Learning rates per parameter group (the paper's defaults) for AdamW."""

    lr_cores: float = 1e-4
    lr_gates: float = 1e-3
    lr_other: float = 5e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)


def param_groups(model: nn.Module, config: OptimizerConfig = OptimizerConfig()) -> list[dict]:
    """Three groups: TT cores, rank gates, everything else (empty groups are left out)."""
    cores, gates = [], []
    for _, module in tt_modules(model):
        cores += list(module.cores)
        gates += list(module.gates)
    taken = {id(p) for p in cores + gates}
    other = [p for p in model.parameters() if id(p) not in taken]
    groups = [
        {"params": cores, "lr": config.lr_cores, "name": "cores"},
        {"params": gates, "lr": config.lr_gates, "name": "gates"},
        {"params": other, "lr": config.lr_other, "name": "other"},
    ]
    return [g for g in groups if g["params"]]


def make_optimizer(model: nn.Module, config: OptimizerConfig = OptimizerConfig()):
    """AdamW over :func:`param_groups` (no weight decay by default, as in the paper)."""
    return torch.optim.AdamW(param_groups(model, config), betas=config.betas,
                             weight_decay=config.weight_decay)


@dataclass(frozen=True)
class StepStats:
    """What one trainer step did: the loss, the objective it minimised, the stage, which term
    was weighted, and the model's size (parameters at the effective ranks) and compression
    (dense size / size) after the step. Late stage: ``scheduled_size`` is the size the step
    budget asks for after this step (S* without a budget), and ``note`` says, while the size is
    above it, why ("no step budget ...", "unreachable ...")."""

    loss: float
    objective: float
    stage: str  # "early" / "late" (CoMERA) or "dense"
    weighted: str  # "loss+rank" (early), "loss" / "size" (late), "loss" (dense)
    size: int
    compression: float
    scheduled_size: float | None = None
    note: str = ""


GradHook = Callable[[nn.Module], None]


def _check_loss(loss: Tensor, step: int) -> None:
    if not bool(torch.isfinite(loss.detach()).all()):
        raise NonFiniteLossError(
            f"step {step}: the loss is {float(loss.detach())}; the step was not applied "
            "(lower the learning rates, or restore the last checkpoint)."
        )


def _check_gradients(model: nn.Module, step: int) -> None:
    """Raise (before the optimizer sees them) when any gradient holds a NaN or an infinity."""
    bad = [name for name, p in model.named_parameters()
           if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
    if bad:
        model.zero_grad(set_to_none=True)
        raise NonFiniteGradientError(
            f"step {step}: non-finite gradients in {', '.join(bad[:5])}"
            f"{' ...' if len(bad) > 5 else ''}; the step was not applied (lower the learning "
            "rates, clip gradients with max_grad_norm, or restore the last checkpoint)."
        )


class _Stepper:
    """The step shared by both trainers: checks, backward, gradient hook, clip, optimizer."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    max_grad_norm: float | None
    grad_hook: GradHook | None
    steps: int
    # float16 training: backward on the scaled objective, unscale before the checks and the
    # clip; a step with overflowing gradients raises NonFiniteGradientError and lowers the scale
    scaler: torch.amp.GradScaler | None = None

    def _apply(self, total: Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        scaler = self.scaler
        (total if scaler is None else scaler.scale(total)).backward()
        if self.grad_hook is not None:
            self.grad_hook(self.model)  # e.g. average gradients over data-parallel workers
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        try:
            _check_gradients(self.model, self.steps)
        except NonFiniteGradientError:
            if scaler is not None:
                scaler.update()  # the next step runs at a lower scale
            raise
        if self.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        if scaler is not None:
            scaler.update()


class DenseTrainer(_Stepper):
    """The baseline's step with the same interface, checks and hooks as :class:`CoMERATrainer`."""

    stage = "dense"

    def __init__(self, model: nn.Module, optimizer=None, max_grad_norm: float | None = None,
                 grad_hook: GradHook | None = None):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else torch.optim.AdamW(
            model.parameters(), lr=1e-3, weight_decay=0.0)
        self.max_grad_norm = max_grad_norm
        self.grad_hook = grad_hook
        self.steps = 0

    def step(self, loss: Tensor, decision_loss: float | None = None) -> StepStats:
        """One optimizer step on ``loss`` (backward, gradient hook, checks, clipping). The stats
        report the dense parameter count at compression 1.0; ``decision_loss`` is accepted only for
        the interface shared with :class:`CoMERATrainer`."""
        _check_loss(loss, self.steps)
        self._apply(loss)
        self.steps += 1
        size = sum(p.numel() for p in self.model.parameters())
        return StepStats(float(loss.detach()), float(loss.detach()), "dense", "loss", size, 1.0)

    def state_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint's ``extra``: the stage (``"dense"``) and the step count."""
        return {"stage": "dense", "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the step count from :meth:`state_dict`'s data."""
        self.steps = int(state["steps"])


class CoMERATrainer(_Stepper):
    """Runs the CoMERA objective: ``step(loss)`` adds the stage's terms, backpropagates, steps.

    ``grad_hook(model)`` runs after backward and before the checks and the optimizer step (a
    data-parallel gradient average goes there). ``step`` raises :class:`NonFiniteLossError` /
    :class:`NonFiniteGradientError` without touching parameters or optimizer state, so a caller
    may skip the batch or stop.

    ``min_rank`` (default 1) is a floor on every bond of every TT layer, in both stages: a step
    that would leave a gate with fewer than ``min_rank`` entries above tau keeps the largest of
    the entries it pruned at their previous values, and the late stage's schedule never prunes
    below it. So no layer is pruned to nothing (a TT token table at rank 0 would map every token
    to the same vector). ``min_rank=0`` allows removing a layer entirely (its weight is then
    exactly zero). A late-stage target below the floor's size is reported when the stage starts
    and in every step's ``note``.
    """

    def __init__(self, model: nn.Module, optimizer=None, lam: float = 0.01,
                 regularizer: str = "l1", max_grad_norm: float | None = None,
                 grad_hook: GradHook | None = None, min_rank: int = 1):
        if not any(True for _ in tt_modules(model)):
            raise ConfigError("the model has no TT layers: convert it with comera.convert_ first.")
        if not (lam >= 0 and math.isfinite(lam)):
            raise ConfigError(f"lam={lam}; the rank-regulariser weight is a finite number >= 0.")
        if regularizer not in REGULARIZERS:
            raise ConfigError(f"regularizer {regularizer!r}; choose one of "
                              f"{', '.join(REGULARIZERS)}.")
        if isinstance(min_rank, bool) or not isinstance(min_rank, int) or min_rank < 0:
            raise ConfigError(f"min_rank={min_rank!r}; the rank floor is an int >= 0 (default 1; "
                              "0 lets a layer be pruned away).")
        self.min_rank = min_rank
        self.model = model
        self.optimizer = optimizer if optimizer is not None else make_optimizer(model)
        self.lam = lam
        self.regularizer = regularizer
        self.max_grad_norm = max_grad_norm
        self.grad_hook = grad_hook
        self.stage = "early"
        self.late: LateStage | None = None
        self._size_reference: float | None = None
        self._late_start: tuple[int, float] | None = None  # (trainer step, size) at the start
        self._late_note = ""
        self.steps = 0

    def objective(self, loss: Tensor, decision_loss: float | None = None) -> tuple[Tensor, str]:
        """The scalar to minimise for this step, and which term was weighted."""
        if self.stage == "early":
            if self.lam == 0:
                return loss, "loss"
            return loss + self.lam * rank_regularizer(self.model, self.regularizer), "loss+rank"
        return self.late.objective(self.model, loss, self._size_reference, decision_loss)

    def step(self, loss: Tensor, decision_loss: float | None = None) -> StepStats:
        """One step on ``loss``. ``decision_loss``: the loss the late stage decides on (the
        all-worker mean under data parallelism; default ``loss``)."""
        _check_loss(loss, self.steps)
        total, which = self.objective(loss, decision_loss)
        layers = [layer for _, layer in tt_modules(self.model)]
        pruned = [(g, ~m) for layer in layers
                  for g, m in zip(layer.gates, layer.gate_masks(), strict=True)]
        late = self.stage == "late"
        before = [g.detach().clone() for layer in layers for g in layer.gates]  # tiny vectors
        self._apply(total)
        self._keep_pruned_(pruned)
        self._hold_floor_([(layer, g) for layer in layers for g in layer.gates], before)
        scheduled, note = None, ""
        if late:
            self._hold_size_target_(layers, before)
            scheduled = self.late.scheduled_size(self._late_start[1],
                                                 self.steps - self._late_start[0])
            if self.late.steps is not None:  # the budget's schedule; else the optimizer's pace
                lower = scheduled - 0.05 * self.late.target_size  # land within 5% of S*
                self._clear_moments_(prune_to_(self.model, scheduled, self.min_rank, lower,
                                               self.late.rounding, self.optimizer))
        self.steps += 1
        size = model_size(self.model)
        if late and (size > self.late.target_size or self._late_note.startswith("below")):
            note = self._late_note
        return StepStats(float(loss.detach()), float(total.detach()), self.stage, which,
                         size, dense_size(self.model) / max(size, 1), scheduled, note)

    def _clear_moments_(self, entries) -> None:
        """Zero the optimizer's per-entry state (Adam's moments) at (gate, index) pairs."""
        with torch.no_grad():
            for gate, i in entries:
                for moment in self.optimizer.state.get(gate, {}).values():
                    if isinstance(moment, Tensor) and moment.shape == gate.shape:
                        moment[i] = 0.0

    def _hold_floor_(self, gates, before: list[Tensor]) -> None:
        """The ``min_rank`` floor: a gate left with fewer than ``min_rank`` live entries by this
        step gets its largest just-pruned entries back at their previous values."""
        with torch.no_grad():
            for (layer, gate), old in zip(gates, before, strict=True):
                alive = gate.detach().abs() > layer.tau
                missing = self.min_rank - int(alive.sum())
                if missing <= 0:
                    continue
                lost = (old.abs() > layer.tau) & ~alive
                order = sorted(lost.nonzero().flatten().tolist(),
                               key=lambda i, old=old: -float(old[i].abs()))
                back = order[:missing]
                for i in back:
                    gate[i] = old[i]
                self._clear_moments_([(gate, i) for i in back])

    def _keep_pruned_(self, pruned) -> None:
        """A pruned gate gets no gradient, but Adam's momentum would carry it back past tau:
        pin it at zero and clear its moments, so pruning is final."""
        with torch.no_grad():
            for gate, off in pruned:
                if not bool(off.any()):
                    continue
                gate[off] = 0.0
                for value in self.optimizer.state.get(gate, {}).values():
                    if isinstance(value, Tensor) and value.shape == gate.shape:
                        value[off] = 0.0

    def _hold_size_target_(self, layers, before: list[Tensor]) -> None:
        """Late stage: a step must not prune far below the size target. Adam moves every gate
        entry at about the same rate, so many cross tau in the same step; when that takes the
        model under S*, the entries pruned this step are restored to their previous values,
        largest first, as long as the size stays at or below S*."""
        target = self.late.target_size
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
                for moment in self.optimizer.state.get(gate, {}).values():
                    if isinstance(moment, Tensor) and moment.shape == gate.shape:
                        moment[i] = 0.0

    def start_late_stage(self, late: LateStage, truncate: bool = True) -> TruncationReport | None:
        """Switch to the late stage (truncating the pruned ranks first, by default)."""
        if not isinstance(late, LateStage):
            raise ConfigError(f"start_late_stage takes a comera.LateStage, got {late!r}.")
        report = self.truncate() if truncate else None
        self.stage = "late"
        self.late = late
        size = float(model_size(self.model))
        self._size_reference = size
        self._late_start = (self.steps, size)
        self._late_note = self._plan_note(late, size)
        if self._late_note:
            log.warning("late stage: %s", self._late_note)
        return report

    def _plan_note(self, late: LateStage, size: float) -> str:
        """Why the late stage may not reach S* (empty when it will): said up front and in the
        step stats, never silently."""
        floor = floor_size(self.model, self.min_rank)
        if size < 0.95 * late.target_size:
            return (f"below: the stage starts at {size:.0f} parameters, under the target "
                    f"{late.target_size:.0f} (the early stage pruned past it, and ranks are not "
                    "grown back); lower lam or the early steps to land on the target")
        if floor > late.target_size:
            return (f"unreachable: the target {late.target_size:.0f} parameters is below the "
                    f"min_rank={self.min_rank} floor of {floor} (lower min_rank or raise the "
                    "target)")
        if late.steps is None and size > late.target_size:
            lrs = [g["lr"] for g in self.optimizer.param_groups if g.get("name") == "gates"]
            lr = lrs[0] if lrs else float("nan")
            tau = max((m.tau for _, m in tt_modules(self.model)), default=0.0)
            need = math.ceil((1.0 - tau) / lr) if lr > 0 else "many"
            return (f"no step budget: the size moves only as fast as the gates' learning rate "
                    f"(lr {lr:g}: ~{need} steps to carry a gate from 1 to tau); give LateStage "
                    "steps=N to land on the target in N steps")
        return ""

    def truncate(self) -> TruncationReport:
        """Remove pruned ranks now (model and optimizer state)."""
        return truncate_(self.model, self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint's ``extra``: stage, step count, late-stage targets."""
        late = None if self.late is None else {
            "target_size": self.late.target_size, "target_loss": self.late.target_loss,
            "size_weight": self.late.size_weight, "steps": self.late.steps,
            "landing": self.late.landing, "rounding": self.late.rounding}
        return {"stage": self.stage, "steps": self.steps, "late": late,
                "size_reference": self._size_reference, "lam": self.lam,
                "late_start": None if self._late_start is None else list(self._late_start),
                "late_note": self._late_note, "min_rank": self.min_rank}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore stage, step count, late-stage targets and ``lam`` from :meth:`state_dict`'s data
        (a :class:`ConfigError` for a state not saved by a CoMERATrainer)."""
        if state.get("stage") not in ("early", "late"):
            raise ConfigError(f"trainer state has stage {state.get('stage')!r}; expected "
                              "'early' or 'late' (was it saved by a CoMERATrainer?).")
        self.stage = state["stage"]
        self.steps = int(state["steps"])
        self.late = None if state["late"] is None else LateStage(**state["late"])
        self._size_reference = state["size_reference"]
        self.lam = float(state.get("lam", self.lam))
        start = state.get("late_start")
        if start is None and self.late is not None:  # saved before step budgets existed
            start = (self.steps, self._size_reference or 0.0)
        self._late_start = None if start is None else (int(start[0]), float(start[1]))
        self._late_note = str(state.get("late_note", ""))
        self.min_rank = int(state.get("min_rank", self.min_rank))
