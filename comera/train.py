"""Rank-adaptive training: optimizer groups and the two-stage CoMERA controller.

    opt = comera.make_optimizer(model)                 # cores / gates / rest, paper defaults
    trainer = comera.CoMERATrainer(model, opt)         # early stage: L + lam * R
    for batch in data:
        stats = trainer.step(loss_fn(model, batch))    # backward + optimizer step
    trainer.start_late_stage(comera.LateStage.from_ratio(model, 3.0, target_loss=0.3))
    ...                                                # late stage: loss or size, each step

The stage boundary truncates the pruned ranks physically (``truncate_``), which also slices the
optimizer state; the compiled plans re-plan for the new shapes on the next forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from comera.errors import ConfigError, NonFiniteGradientError, NonFiniteLossError
from comera.objective import REGULARIZERS, LateStage, rank_regularizer
from comera.size import dense_size, model_size, tt_modules
from comera.truncate import TruncationReport, truncate_


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
    (dense size / size) after the step."""

    loss: float
    objective: float
    stage: str  # "early" / "late" (CoMERA) or "dense"
    weighted: str  # "loss+rank" (early), "loss" / "size" (late), "loss" (dense)
    size: int
    compression: float


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
    """

    def __init__(self, model: nn.Module, optimizer=None, lam: float = 0.01,
                 regularizer: str = "l1", max_grad_norm: float | None = None,
                 grad_hook: GradHook | None = None):
        if not any(True for _ in tt_modules(model)):
            raise ConfigError("the model has no TT layers: convert it with comera.convert_ first.")
        if not (lam >= 0 and math.isfinite(lam)):
            raise ConfigError(f"lam={lam}; the rank-regulariser weight is a finite number >= 0.")
        if regularizer not in REGULARIZERS:
            raise ConfigError(f"regularizer {regularizer!r}; choose one of "
                              f"{', '.join(REGULARIZERS)}.")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else make_optimizer(model)
        self.lam = lam
        self.regularizer = regularizer
        self.max_grad_norm = max_grad_norm
        self.grad_hook = grad_hook
        self.stage = "early"
        self.late: LateStage | None = None
        self._size_reference: float | None = None
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
        before = [g.detach().clone() for layer in layers for g in layer.gates] if late else []
        self._apply(total)
        self._keep_pruned_(pruned)
        if late:
            self._hold_size_target_(layers, before)
        self.steps += 1
        size = model_size(self.model)
        return StepStats(float(loss.detach()), float(total.detach()), self.stage, which,
                         size, dense_size(self.model) / max(size, 1))

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
        self._size_reference = float(model_size(self.model))
        return report

    def truncate(self) -> TruncationReport:
        """Remove pruned ranks now (model and optimizer state)."""
        return truncate_(self.model, self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint's ``extra``: stage, step count, late-stage targets."""
        late = None if self.late is None else {
            "target_size": self.late.target_size, "target_loss": self.late.target_loss,
            "size_weight": self.late.size_weight}
        return {"stage": self.stage, "steps": self.steps, "late": late,
                "size_reference": self._size_reference, "lam": self.lam}

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
