"""The settings of a training run in five groups, each a frozen dataclass that checks its own
fields when it is made; :class:`~comera.experiments.engine.EngineConfig` is all five.

    from comera.experiments.engine import EngineConfig
    from comera.experiments.engine_config import LateSettings, OptimSettings

    config = EngineConfig(lr=3e-4, target_compression=20)  # flat, every setting by its name
    config = EngineConfig.from_groups(optim=OptimSettings(lr=3e-4),
                                      late=LateSettings(target_compression=20))  # the same
    config.late  # LateSettings(target_compression=20, ...): what the late stage reads
    config.lr    # 3e-4

The groups:

- :class:`OptimSettings` (``config.optim``): the optimisation schedule: step counts, batch,
  learning rates, warm-up, optimizer, schedule, clipping;
- :class:`RunSettings` (``config.run``): the run itself: stages, layer kind, seed, evaluation
  and checkpoint cadence, the non-finite policy;
- :class:`RankSettings` (``config.ranks``): the early stage's rank objective: the regulariser,
  its weight, the optional size target;
- :class:`LateSettings` (``config.late``): the late stage: its size target, loss target,
  allocation and landing;
- :class:`RuntimeSettings` (``config.runtime``): where and how the steps run: device, precision,
  compile, memory, threads, block checkpointing, FSDP; all of it but ``precision`` leaves the
  results unchanged (:data:`RESULT_FREE`).

A setting keeps its flat name inside its group (``LateSettings.late_landing``): the names are
the contract of ``EngineConfig(...)``, ``dataclasses.replace``, checkpoints and summaries. Each
group builds the object of the library below that it configures (:meth:`RankSettings.early_stage`,
:meth:`LateSettings.late_stage`), which takes plain values.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

import comera
from comera import ConfigError
from comera.experiments.checks import (
    MAX_INT,
    MAX_THREADS,
    ON_NONFINITE,
    PRECISIONS,
    STAGES,
    check_int,
    check_number,
)
from comera.experiments.optim_schedule import OPTIMIZERS, SCHEDULES, lr_factor
from comera.formats.registry import DENSE, check_layer_format
from comera.formats.tt_flag import FLAG_FORMAT, format_from_tt
from comera.layers.linear import FRESH_FORMAT, check_memory
from comera.ranks.allocate import spectrum_applies
from comera.ranks.objective import ALLOCATIONS, REGULARIZERS
from comera.ranks.size import gated_layers
from comera.training.early import EarlyStage

#: The late stage's allocations: ``"auto"`` (spectrum for balanced cores on exact chains, else
#: prune) and :data:`comera.ranks.objective.ALLOCATIONS`.
LATE_ALLOCATIONS = ("auto", *ALLOCATIONS)

__all__ = ["GROUPS", "RESULT_FREE", "LateSettings", "OptimSettings", "RankSettings",
           "RunSettings", "RuntimeSettings"]

_RATE = "a learning rate is a finite number > 0"


def _choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{name}={value!r}; choose one of {', '.join(choices)}.")


def _fraction(name: str, value: Any) -> None:
    if not (isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 1):
        raise ConfigError(f"{name}={value!r}; give a fraction in (0, 1].")


@dataclass(frozen=True)
class OptimSettings:
    """The optimisation schedule: ``steps_early`` + ``steps_late`` steps of ``batch_size``
    examples (the global batch: split over data-parallel workers), the optimizer and its rates
    (:mod:`comera.experiments.optim_schedule`), the warm-up and schedule, gradient clipping."""

    steps_early: int = 300
    steps_late: int = 150
    batch_size: int = 32
    lr: float = 1e-3  # TT cores, and every parameter of a dense model
    lr_gates: float = 1e-2
    lr_other: float | None = None  # non-TT parameters of a TT model (default: lr)
    warmup: int = 0  # linear learning-rate warm-up, in steps
    # the optimizer and the rate after the warm-up: "groups" (named AdamW groups) or "adamw"
    # (AdamW over model.parameters()); "constant" or "cosine"
    optimizer: str = "groups"
    schedule: str = "constant"
    max_grad_norm: float | None = 1.0  # None: no clipping

    def __post_init__(self) -> None:
        for name, low in (("steps_early", 0), ("steps_late", 0), ("warmup", 0),
                          ("batch_size", 1)):
            check_int(name, getattr(self, name), low, MAX_INT)
        check_number("lr", self.lr, _RATE, positive=True)
        check_number("lr_gates", self.lr_gates, _RATE, positive=True)
        if self.lr_other is not None:
            check_number("lr_other", self.lr_other, f"{_RATE} (or None: lr)", positive=True)
        if self.max_grad_norm is not None:
            check_number("max_grad_norm", self.max_grad_norm, "it is a finite number > 0 (or "
                          "None: no clipping)", positive=True)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("schedule", self.schedule, SCHEDULES)

    @property
    def total_steps(self) -> int:
        """Steps of a whole run: early-stage steps plus late-stage steps."""
        return self.steps_early + self.steps_late

    def lr_factor(self, step: int, total: int) -> float:
        """The factor on every base rate at ``step`` of a ``total``-step run: the warm-up, then
        the schedule (:func:`comera.experiments.optim_schedule.lr_factor`)."""
        return lr_factor(step, self.warmup, total, self.schedule)


@dataclass(frozen=True)
class RunSettings:
    """The run itself: ``stage`` (the CoMERA stages to run: early, late or both), ``format``
    (the layer kind: a registered format, a CoMERA run, or ``"dense"``, the baseline; by
    default :data:`~comera.layers.linear.FRESH_FORMAT`, the format of layers trained from
    scratch), the ``seed``, an evaluation every ``eval_every`` steps, a checkpoint every
    ``checkpoint_every`` (0: only at the stage boundary and at the end), and what a non-finite
    loss or gradient does (``"stop"``: raise TrainingStopped; ``"skip"``: drop the batch, up to
    ``max_skips`` in a row)."""

    stage: str = "both"
    # the run's layer kind, from the CLI through Task.build_model to the layers
    format: str = FRESH_FORMAT
    seed: int = 0
    eval_every: int = 50
    checkpoint_every: int = 0
    on_nonfinite: str = "stop"
    max_skips: int = 10

    def __post_init__(self) -> None:
        for name, low in (("checkpoint_every", 0), ("max_skips", 0), ("seed", 0),
                          ("eval_every", 1)):
            check_int(name, getattr(self, name), low, MAX_INT)
        _choice("stage", self.stage, STAGES)
        _choice("on_nonfinite", self.on_nonfinite, ON_NONFINITE)
        check_layer_format(self.format)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A config pickled before the run had a layer kind (it trained TT, or dense by the
        flag beside it) loads as ``format="tt"``, not as today's default."""
        self.__dict__.update({"format": FLAG_FORMAT, **state})

    @property
    def compressed(self) -> bool:
        """Whether the run is a CoMERA run (its layers in a format), not the dense baseline."""
        return self.format != DENSE

    def model_format(self, tt: bool | None = None) -> str:
        """The layer kind a run builds: ``format``. (Deprecated until 0.3.0: a ``tt`` flag,
        True for ``format``, False for ``"dense"``.)"""
        if tt is None:
            return self.format
        return format_from_tt(tt, self.format,
                              "model_format() with the kind in config.format={}")


@dataclass(frozen=True)
class RankSettings:
    """The early stage's objective ``loss + lam * R``: ``regularizer`` R and its weight ``lam``,
    and an optional size target (:class:`~comera.training.early.EarlyStage`): the compression
    ``early_target`` of the gated layers against dense at which the stage stops pruning (None:
    lam alone decides), reached along a schedule over the first ``early_landing`` of the early
    steps."""

    lam: float = 0.05
    regularizer: str = "l1"
    early_target: float | None = None
    early_landing: float = 0.5

    def __post_init__(self) -> None:
        check_number("lam", self.lam, "the rank-regulariser weight is a finite number >= 0")
        _choice("regularizer", self.regularizer, REGULARIZERS)
        if self.early_target is not None:
            check_number("early_target", self.early_target, "a compression against dense is a "
                          "finite number > 1 (or None)", low=1.0, positive=True)
        _fraction("early_landing", self.early_landing)

    def early_stage(self, model: nn.Module, steps: int) -> EarlyStage | None:
        """The size target of an early stage of ``steps`` steps on ``model`` (None without
        ``early_target``)."""
        if self.early_target is None:
            return None
        return EarlyStage.for_compression(model, self.early_target, steps, self.early_landing)


@dataclass(frozen=True)
class LateSettings:
    """The late stage: shrink the gated layers to ``target_compression`` times below their
    dense size while the training loss stays near its target L*. L* is ``late_target_loss``
    when given (0: the loss alone is weighted while the step budget prunes along the schedule),
    else the mean loss of the early stage's last steps times ``1 + late_loss_slack``.
    ``late_allocation``: ``"prune"`` shrinks along the step budget, on the target after
    ``late_landing`` of the late steps; ``"spectrum"`` (tensor-train chains) fixes the final
    shape from the bonds' spectra when the stage starts and trains that shape throughout;
    ``"auto"`` (the default) is ``"spectrum"`` for balanced cores on chains that round exactly
    (a balanced model spreads its weight over its whole rank, and pruning its gates costs most
    of what it learned), else ``"prune"`` (plain cores: the paper's schedule)."""

    target_compression: float = 150.0
    late_loss_slack: float = 0.05
    late_target_loss: float | None = None
    late_allocation: str = "auto"
    late_landing: float = 0.75

    def __post_init__(self) -> None:
        check_number("late_loss_slack", self.late_loss_slack, "it is a finite number >= 0, "
                      "e.g. 0.05")
        check_number("target_compression", self.target_compression, "it must be > 1 (dense "
                      "size / TT size), e.g. 50", low=1.0, positive=True)
        _fraction("late_landing", self.late_landing)
        if self.late_target_loss is not None:
            check_number("late_target_loss", self.late_target_loss, "a loss target is a finite "
                          "number >= 0 (or None: from the early stage)")
        _choice("late_allocation", self.late_allocation, LATE_ALLOCATIONS)

    def loss_target(self, early_losses: Sequence[float]) -> float:
        """L*: ``late_target_loss``, else the mean of ``early_losses`` (the early stage's last
        training losses) times ``1 + late_loss_slack``."""
        if self.late_target_loss is not None:
            return self.late_target_loss
        if not early_losses:
            raise ConfigError("the late stage needs a loss target from the early stage, but no "
                              "early step ran; set steps_early >= 1.")
        return statistics.fmean(early_losses) * (1.0 + self.late_loss_slack)

    def late_stage(self, model: nn.Module, target_loss: float, steps: int) -> comera.LateStage:
        """The late stage of ``steps`` steps on ``model``, at the loss target ``target_loss``.
        The size target counts the gated layers only (against their dense size), the rest kept
        as it is; the step budget lands the stage on it by its end, whatever the rates."""
        return comera.LateStage.for_compression(model, self.target_compression,
                                                target_loss=target_loss, steps=steps,
                                                landing=self.late_landing,
                                                allocation=self.allocation_for(model))

    def allocation_for(self, model: nn.Module) -> str:
        """The late stage's allocation on ``model``: ``late_allocation``, with ``"auto"`` read
        as ``"spectrum"`` where :func:`~comera.ranks.allocate.spectrum_applies` and some gated
        layer is balanced, else ``"prune"``."""
        if self.late_allocation != "auto":
            return self.late_allocation
        layers = list(gated_layers(model))
        balanced = any(getattr(layer, "parametrization", None) == "balanced"
                       for _, layer in layers)
        return "spectrum" if balanced and spectrum_applies(layers) else "prune"


@dataclass(frozen=True)
class RuntimeSettings:
    """Where and how the steps run: ``device``; ``precision`` (``"bf16"`` / ``"fp16"``: the
    forward under torch.autocast, fp16 on CUDA only, with a GradScaler); ``compile`` (torch.
    compile the training forward); ``memory`` (what gated layers keep for the backward,
    tncomp's option: ``"fast"``, ``"balanced"``, ``"min"``); ``threads`` (CPU threads; 0: the
    faster of 1 and the current count, timed at the start); ``checkpoint_blocks`` (recompute
    each encoder block in the backward, for the models that have blocks: the transformers);
    ``fsdp`` (FSDP2 over the workers: dense parts sharded, gated layers replicated). Every one
    but ``precision`` trades time for memory or picks the hardware and leaves the results
    unchanged (:data:`RESULT_FREE`)."""

    device: str = "cpu"
    precision: str = "fp32"
    compile: bool = False
    memory: str = "fast"
    threads: int = 0
    checkpoint_blocks: bool = False
    fsdp: bool = False

    def __post_init__(self) -> None:
        check_int("threads", self.threads, 0, MAX_THREADS)
        for name in ("compile", "checkpoint_blocks", "fsdp"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r}; it is True or False.")
        _choice("precision", self.precision, tuple(PRECISIONS))
        if not isinstance(self.device, str) or not self.device.strip():
            raise ConfigError(f"device={self.device!r} is not a device; use cpu, cuda or "
                              "cuda:1.")
        if self.precision == "fp16" and not self.device.startswith("cuda"):
            raise ConfigError(f"precision='fp16' trains with a CUDA GradScaler; device "
                              f"{self.device!r} has none: use precision='bf16' on the CPU.")
        if not isinstance(self.memory, str):
            raise ConfigError(f"memory={self.memory!r}; choose one of fast, balanced, min.")
        check_memory(self.memory)

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """The forward's precision on ``device``: torch.autocast at ``precision`` (nothing for
        fp32)."""
        dtype = PRECISIONS[self.precision]
        return (contextlib.nullcontext() if dtype is None
                else torch.autocast(device.type, dtype=dtype))


# the settings a resumed run may change: they leave its results as they were
RESULT_FREE = tuple(f.name for f in fields(RuntimeSettings) if f.name != "precision")

# each group by the name of EngineConfig's property that returns it
GROUPS: dict[str, type] = {"optim": OptimSettings, "run": RunSettings, "ranks": RankSettings,
                           "late": LateSettings, "runtime": RuntimeSettings}

