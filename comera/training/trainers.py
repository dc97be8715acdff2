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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from comera.errors import ConfigError, NonFiniteGradientError
from comera.lean.readback import all_finite
from comera.ranks.objective import LateStage
from comera.ranks.size import gated_layers
from comera.ranks.truncate import TruncationReport
from comera.training.controller import RankController, StepStats, check_loss
from comera.training.early import EarlyStage
from tncomp.extend import time_calls

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
    times = time_calls(dict.fromkeys(candidates, step), 1, repeats,
                       before=torch.set_num_threads)
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

    def __post_init__(self) -> None:
        for key in ("lr_cores", "lr_gates", "lr_other", "weight_decay"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    math.isfinite(value) and value >= 0):
                raise ConfigError(f"{key}={value!r}; a finite number >= 0 (e.g. {key}=1e-3).")
        betas = self.betas
        if (not isinstance(betas, tuple | list) or len(betas) != 2
                or any(isinstance(b, bool) or not isinstance(b, int | float)
                       or not 0 <= b < 1 for b in betas)):
            raise ConfigError(f"betas={betas!r}; two numbers in [0, 1), e.g. betas=(0.9, 0.999).")
        object.__setattr__(self, "betas", tuple(float(b) for b in betas))


def param_groups(model: nn.Module, config: OptimizerConfig = OptimizerConfig()) -> list[dict]:
    """Three groups: TT cores, rank gates, everything else (empty groups are left out)."""
    cores, gates = [], []
    for _, module in gated_layers(model):
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


GradHook = Callable[[nn.Module], None]


def _check_gradients(model: nn.Module, step: int) -> None:
    """Raise (before the optimizer sees them) when any gradient holds a NaN or an infinity."""
    if all_finite([p.grad for p in model.parameters() if p.grad is not None]):
        return  # one read per device; the names are looked for only when something is wrong
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
        check_loss(loss, self.steps)
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


def _delegate(name: str, doc: str, settable: bool = True) -> property:
    """A trainer property reading (and setting) the controller's attribute ``name``."""
    def get(self):
        return getattr(self.controller, name)

    def put(self, value) -> None:
        setattr(self.controller, name, value)

    get.__doc__ = doc
    return property(get, put if settable else None)


class CoMERATrainer(_Stepper):
    """Runs the CoMERA objective: ``step(loss)`` adds the stage's terms, backpropagates, steps.

    It is a :class:`~comera.training.controller.RankController` (``self.controller``: the
    objective, the gate bookkeeping and the stages) plus the backward, the checks and the
    optimizer step; a loop of one's own calls the controller directly and gets the same steps.

    ``grad_hook(model)`` runs after backward and before the checks and the optimizer step (a
    data-parallel gradient average goes there). ``step`` raises :class:`NonFiniteLossError` /
    :class:`NonFiniteGradientError` without touching parameters or optimizer state, so a caller
    may skip the batch or stop.

    ``min_rank`` (default 1) is a floor on every bond of every TT layer, in both stages;
    ``early``: an early-stage size target (:class:`~comera.training.early.EarlyStage`) the
    early stage stops at (see :class:`~comera.training.controller.RankController`).
    """

    def __init__(self, model: nn.Module, optimizer=None, lam: float = 0.01,
                 regularizer: str = "l1", max_grad_norm: float | None = None,
                 grad_hook: GradHook | None = None, min_rank: int = 1,
                 early: EarlyStage | None = None):
        if not any(True for _ in gated_layers(model)):
            raise ConfigError("the model has no TT layers: convert it with comera.convert_ first.")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else make_optimizer(model)
        self.controller = RankController(model, self.optimizer, lam, regularizer, min_rank,
                                         early)
        self.max_grad_norm = max_grad_norm
        self.grad_hook = grad_hook

    # the controller's state, read and set through the trainer as before
    stage = _delegate("stage", "The stage: 'early' or 'late'.")
    steps = _delegate("steps", "Optimizer steps taken.")
    lam = _delegate("lam", "The early stage's rank-regulariser weight (settable mid-run).")
    min_rank = _delegate("min_rank", "The rank floor on every bond.")
    late = _delegate("late", "The late stage's targets (None in the early stage).", False)
    regularizer = _delegate("regularizer", "The early stage's regulariser ('l1', ...).", False)

    def objective(self, loss: Tensor, decision_loss: float | None = None) -> tuple[Tensor, str]:
        """The scalar to minimise for this step, and which term was weighted."""
        return self.controller.objective(loss, decision_loss)

    def step(self, loss: Tensor, decision_loss: float | None = None) -> StepStats:
        """One step on ``loss``. ``decision_loss``: the loss the late stage decides on (the
        all-worker mean under data parallelism; default ``loss``)."""
        total = self.controller.loss(loss, decision_loss)
        try:
            self._apply(total)
        except BaseException:
            self.controller.discard_step()
            raise
        return self.controller.after_step(self.optimizer)

    def start_late_stage(self, late: LateStage, truncate: bool = True) -> TruncationReport | None:
        """Switch to the late stage (truncating the pruned ranks first, by default)."""
        return self.controller.start_late_stage(late, truncate, self.optimizer)

    def truncate(self) -> TruncationReport:
        """Remove pruned ranks now (model and optimizer state)."""
        return self.controller.truncate(self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint's ``extra``: stage, step count, late-stage targets."""
        return self.controller.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore stage, step count, late-stage targets and ``lam`` from :meth:`state_dict`'s data
        (a :class:`ConfigError` for a state not saved by a CoMERATrainer)."""
        self.controller.load_state_dict(state)
