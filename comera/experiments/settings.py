"""How to train: :class:`EngineConfig`, every field checked when it is made, and the checks a
run's settings must pass against the machine and the task before any training
(:func:`check_settings`, :func:`check_task`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

import comera
from comera import ConfigError
from comera.experiments.schedule import OPTIMIZERS, SCHEDULES
from comera.experiments.task import Task, build_task_model
from comera.formats.registry import DENSE, check_layer_format
from comera.layers.linear import check_memory
from comera.ranks.objective import REGULARIZERS, floor_size

__all__ = ["MAX_INT", "PRECISIONS", "EngineConfig", "check_device", "check_int", "check_settings",
           "check_task"]

STAGES = ("early", "late", "both")
ON_NONFINITE = ("stop", "skip")
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # autocast dtype
MAX_INT = 2**63 - 1  # torch counts steps, seeds and indices in int64
MAX_THREADS = 1024


def check_int(name: str, value: Any, low: int, high: int) -> None:
    """``value`` is an int (not a bool) in ``[low, high]``, or a ConfigError naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r}; it is a whole number >= {low}.")
    if not low <= value <= high:
        raise ConfigError(f"{name}={value}; it must be between {low} and {high}.")


def check_number(name: str, value: Any, rule: str, low: float = 0.0,
                  positive: bool = False) -> None:
    """``value`` is a finite real number >= ``low`` (> with ``positive``), else a ConfigError
    naming it and ``rule``."""
    ok = (isinstance(value, int | float) and not isinstance(value, bool)
          and math.isfinite(value) and (value > low if positive else value >= low))
    if not ok:
        raise ConfigError(f"{name}={value!r}; {rule}.")


@dataclass(frozen=True)
class EngineConfig:
    """How to train; the task decides what. ``stage`` picks the CoMERA stages to run."""

    steps_early: int = 300
    steps_late: int = 150
    batch_size: int = 32  # the global batch: split over data-parallel workers
    lr: float = 1e-3  # TT cores, and every parameter of a dense model
    lr_gates: float = 1e-2
    lr_other: float | None = None  # non-TT parameters of a TT model (default: lr)
    warmup: int = 0  # linear learning-rate warm-up, in steps
    lam: float = 0.05  # early stage: weight of the rank regulariser
    regularizer: str = "l1"
    target_compression: float = 150.0  # late stage: TT layers vs their dense size
    # late stage: the loss target L* is the mean training loss of the last early steps, times
    # (1 + late_loss_slack): shrink while the loss stays near what the early stage reached
    late_loss_slack: float = 0.05
    stage: str = "both"
    eval_every: int = 50
    checkpoint_every: int = 0  # 0: only at the stage boundary and at the end
    on_nonfinite: str = "stop"  # "stop": raise TrainingStopped; "skip": drop the batch
    max_skips: int = 10  # consecutive skipped steps before stopping anyway
    max_grad_norm: float | None = 1.0
    seed: int = 0
    device: str = "cpu"
    precision: str = "fp32"  # "bf16" / "fp16": the forward under torch.autocast (fp16: CUDA only,
    compile: bool = False  # with a GradScaler); compile: torch.compile the training forward
    # what TT layers keep for the backward (tncomp's memory option): "fast", "balanced", "min"
    memory: str = "fast"
    threads: int = 0  # CPU threads; 0: the faster of 1 and the current count, timed at the start
    # recompute each encoder block in the backward (models with ``checkpoint_blocks``: the
    # transformers); like memory, it trades time for memory and leaves the results unchanged
    checkpoint_blocks: bool = False
    fsdp: bool = False  # FSDP2 over the workers: dense parts sharded, TT layers replicated
    # the CoMERA run's layer kind: a registered format ("tt", "tucker", ...; the dense run is
    # the other variant), from the CLI through Task.build_model to the layers
    format: str = "tt"
    # the optimizer and the rate after the warm-up (comera.experiments.schedule): "groups"
    # (named AdamW groups) or "adamw" (AdamW over model.parameters()); "constant" or "cosine"
    optimizer: str = "groups"
    schedule: str = "constant"
    # the late stage's loss target L*: None takes it from the early stage's last losses (times
    # 1 + late_loss_slack); a number fixes it (0: the late stage weights the loss alone while
    # its step budget prunes along the schedule)
    late_target_loss: float | None = None
    # the early stage's size target (comera.training.early.EarlyStage): the compression of the
    # gated layers against dense at which it stops pruning (None: lam alone decides), reached
    # along a schedule over the first early_landing of the early steps
    early_target: float | None = None
    early_landing: float = 0.5

    def __post_init__(self) -> None:
        """Check every field (type, range, finiteness) before anything is built."""
        for name, low in (("steps_early", 0), ("steps_late", 0), ("warmup", 0),
                          ("checkpoint_every", 0), ("max_skips", 0), ("threads", 0),
                          ("seed", 0), ("batch_size", 1), ("eval_every", 1)):
            check_int(name, getattr(self, name), low, MAX_THREADS if name == "threads"
                       else MAX_INT)
        check_number("lr", self.lr, "a learning rate is a finite number > 0", positive=True)
        check_number("lr_gates", self.lr_gates, "a learning rate is a finite number > 0",
                      positive=True)
        if self.lr_other is not None:
            check_number("lr_other", self.lr_other, "a learning rate is a finite number > 0 "
                          "(or None: lr)", positive=True)
        check_number("lam", self.lam, "the rank-regulariser weight is a finite number >= 0")
        check_number("late_loss_slack", self.late_loss_slack, "it is a finite number >= 0, "
                      "e.g. 0.05")
        if self.max_grad_norm is not None:
            check_number("max_grad_norm", self.max_grad_norm, "it is a finite number > 0 (or "
                          "None: no clipping)", positive=True)
        check_number("target_compression", self.target_compression, "it must be > 1 (dense "
                      "size / TT size), e.g. 50", low=1.0, positive=True)
        for name in ("compile", "checkpoint_blocks", "fsdp"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r}; it is True or False.")
        if self.early_target is not None:
            check_number("early_target", self.early_target, "a compression against dense is a "
                          "finite number > 1 (or None)", low=1.0, positive=True)
        if not (isinstance(self.early_landing, int | float) and not isinstance(
                self.early_landing, bool) and 0 < self.early_landing <= 1):
            raise ConfigError(f"early_landing={self.early_landing!r}; give a fraction in (0, 1].")
        if self.late_target_loss is not None:
            check_number("late_target_loss", self.late_target_loss, "a loss target is a finite "
                          "number >= 0 (or None: from the early stage)")
        for name, choices in (("stage", STAGES), ("on_nonfinite", ON_NONFINITE),
                              ("precision", tuple(PRECISIONS)), ("regularizer", REGULARIZERS),
                              ("optimizer", OPTIMIZERS), ("schedule", SCHEDULES)):
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in choices:
                raise ConfigError(f"{name}={getattr(self, name)!r}; choose one of "
                                  f"{', '.join(choices)}.")
        if not isinstance(self.device, str) or not self.device.strip():
            raise ConfigError(f"device={self.device!r} is not a device; use cpu, cuda or "
                              "cuda:1.")
        if self.precision == "fp16" and not self.device.startswith("cuda"):
            raise ConfigError(f"precision='fp16' trains with a CUDA GradScaler; device "
                              f"{self.device!r} has none: use precision='bf16' on the CPU.")
        if not isinstance(self.memory, str):
            raise ConfigError(f"memory={self.memory!r}; choose one of fast, balanced, min.")
        check_memory(self.memory)
        if self.format == DENSE:
            raise ConfigError("format='dense': the dense model is the run without CoMERA (tt="
                              "False, variant dense); give the CoMERA run a registered format, "
                              "e.g. 'tt'.")
        check_layer_format(self.format)

    def model_format(self, tt: bool) -> str:
        """The layer kind a run builds: ``format`` for a CoMERA run, ``"dense"`` otherwise."""
        return self.format if tt else DENSE

    @property
    def total_steps(self) -> int:
        """Steps of a whole run: early-stage steps plus late-stage steps."""
        return self.steps_early + self.steps_late


def check_device(device: str) -> torch.device:
    """``device`` parsed, if this machine has it: cpu, cuda[:k] (with CUDA) or mps (on Apple)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"device={device!r} is not a device; use cpu, cuda or cuda:1.") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={device!r}: CUDA is not available here; use cpu.")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ConfigError(f"device={device!r}: this machine has {torch.cuda.device_count()} "
                              "CUDA device(s); use cuda:0 .. cuda:"
                              f"{torch.cuda.device_count() - 1}.")
    elif parsed.type == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigError(f"device={device!r}: MPS is not available here; use cpu.")
    elif parsed.type != "cpu":
        raise ConfigError(f"device={device!r}: training runs on cpu, cuda or mps, not "
                          f"{parsed.type}.")
    return parsed


def check_settings(config: EngineConfig, tt: bool = True, world_size: int = 1) -> None:
    """Refuse, before any training, settings that cannot run to the end: an unknown or absent
    device, a run of no steps, a late stage without early steps to take its loss target from, a
    global batch that the workers cannot split evenly. ``tt``: a CoMERA run is among those to
    come. Each check names the setting and the fix; every engine option is checked here."""
    check_device(config.device)
    if world_size < 1:
        raise ConfigError(f"{world_size} worker processes; use at least 1.")
    if config.batch_size % world_size:
        raise ConfigError(f"batch_size={config.batch_size} cannot be split over {world_size} "
                          "workers; use a multiple of the worker count, e.g. "
                          f"{max(world_size, config.batch_size // world_size * world_size)}.")
    if config.fsdp and (world_size < 2 or config.precision == "fp16"):
        raise ConfigError(f"fsdp=True with {world_size} worker(s), precision={config.precision!r}"
                          ": FSDP (--fsdp) shards over 2 or more workers (--nproc N) and runs "
                          "fp32 or bf16.")
    steps = config.steps_early if config.stage == "early" else config.total_steps
    if steps < 1:
        raise ConfigError(f"steps_early={config.steps_early}, steps_late={config.steps_late} "
                          f"with stage={config.stage!r}: nothing would be trained; set "
                          "steps_early >= 1.")
    if tt and config.stage != "early" and config.steps_late and config.steps_early < 1:
        raise ConfigError(f"steps_early={config.steps_early}: the late stage takes its loss "
                          "target from the early stage's last steps; set steps_early >= 1.")


def check_task(task: Task, config: EngineConfig, tt: bool = True) -> None:
    """Refuse, before any training, settings that ``task`` cannot meet: a batch larger than its
    training split, or (``tt`` with a late stage) a ``target_compression`` beyond what its TT
    layers reach with every rank at 1. Builds the TT model once to measure it; the RNG states
    are left as they were."""
    size = task.train_size()
    if config.batch_size > size:
        raise ConfigError(f"batch_size={config.batch_size} exceeds the {size} training examples "
                          f"of task {task.name!r}; use batch_size <= {size}.")
    if not (tt and config.stage != "early" and config.steps_late):
        return
    with torch.random.fork_rng(devices=[]):
        model = build_task_model(task, config.model_format(True))
    dense = comera.dense_size(model, only=comera.GatedLayer)
    non_tt = comera.model_size(model) - comera.model_size(model, only=comera.GatedLayer)
    floor = max(1, floor_size(model, 1) - non_tt)  # the TT layers with every rank at 1
    if config.target_compression > dense / floor:
        most = math.floor(dense / floor * 10) / 10
        raise ConfigError(f"target_compression={config.target_compression:g} cannot be reached: "
                          f"the TT layers of task {task.name!r} shrink at most {most:g}x "
                          f"(every rank 1: {floor} of {dense} parameters); choose "
                          f"target_compression <= {most:g}.")
