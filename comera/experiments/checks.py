"""The checks a run's settings pass, all before any training: each field of
:class:`~comera.experiments.engine.EngineConfig` when it is made (:func:`check_int`,
:func:`check_number` and the choices below), and the settings against the machine and the task
(:func:`check_device`, :func:`check_settings`, :func:`check_task`)."""

from __future__ import annotations

import math
from typing import Any

import torch

import comera
from comera import CheckpointError, ConfigError
from comera.experiments.task import Task, build_task_model, run_format
from comera.formats.registry import DENSE
from comera.numbers import is_int
from comera.ranks.objective import floor_size
from comera.ranks.size import dense_size

__all__ = ["MAX_INT", "ON_NONFINITE", "PRECISIONS", "STAGES", "check_device", "check_int",
           "check_kept_parametrization", "check_number", "check_settings", "check_task",
           "parametrizations"]

STAGES = ("early", "late", "both")
ON_NONFINITE = ("stop", "skip")
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # autocast dtype
MAX_INT = 2**63 - 1  # torch counts steps, seeds and indices in int64
MAX_THREADS = 1024


def check_int(name: str, value: Any, low: int, high: int) -> None:
    """``value`` is an int (not a bool) in ``[low, high]``, or a ConfigError naming it."""
    if not is_int(value, None):
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


def check_settings(config: Any, tt: bool | None = None, world_size: int = 1) -> None:
    """Refuse, before any training, settings that cannot run to the end: an unknown or absent
    device, a run of no steps, a late stage without early steps to take its loss target from (a
    CoMERA run's: ``config.format`` not ``"dense"``), a global batch that the workers cannot
    split evenly. Each check names the setting and the fix; every engine option is checked here.
    ``tt``: the flag of before, deprecated (see :func:`~comera.experiments.task.run_format`)."""
    compressed = run_format(config, tt, "check_settings(replace(config, format={}))") != DENSE
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
    if compressed and config.stage != "early" and config.steps_late and config.steps_early < 1:
        raise ConfigError(f"steps_early={config.steps_early}: the late stage takes its loss "
                          "target from the early stage's last steps; set steps_early >= 1.")


def check_task(task: Task, config: Any, tt: bool | None = None) -> None:
    """Refuse, before any training, settings that ``task`` cannot meet: a batch larger than its
    training split, or (a CoMERA run with a late stage) a ``target_compression`` beyond what its
    gated layers reach with every rank at 1. Builds the model of ``config.format`` once to
    measure it; the RNG states are left as they were. ``tt``: the flag of before, deprecated
    (see :func:`~comera.experiments.task.run_format`)."""
    format = run_format(config, tt, "check_task(task, replace(config, format={}))")
    size = task.train_size()
    if config.batch_size > size:
        raise ConfigError(f"batch_size={config.batch_size} exceeds the {size} training examples "
                          f"of task {task.name!r}; use batch_size <= {size}.")
    if not (format != DENSE and config.stage != "early" and config.steps_late):
        return
    with torch.random.fork_rng(devices=[]):
        model = build_task_model(task, format)
    dense = dense_size(model, only=comera.GatedLayer)
    non_tt = comera.model_size(model) - comera.model_size(model, only=comera.GatedLayer)
    floor = max(1, floor_size(model, 1) - non_tt)  # the TT layers with every rank at 1
    if config.target_compression > dense / floor:
        most = math.floor(dense / floor * 10) / 10
        raise ConfigError(f"target_compression={config.target_compression:g} cannot be reached: "
                          f"the TT layers of task {task.name!r} shrink at most {most:g}x "
                          f"(every rank 1: {floor} of {dense} parameters); choose "
                          f"target_compression <= {most:g}.")


def parametrizations(model: Any) -> dict[str, tuple[str, tuple[float, ...]]]:
    """Per gated layer of ``model``: its parametrization and its cores' forward multipliers
    (what :func:`check_kept_parametrization` compares before and after a resume's load)."""
    return {name: (layer.parametrization, tuple(layer.core_scale_values))
            for name, layer in comera.gated_layers(model)}


def check_kept_parametrization(built: dict[str, tuple[str, tuple[float, ...]]], model: Any,
                               path: Any) -> None:
    """Refuse a resume whose model was built with another parametrization than the checkpoint
    at ``path`` was trained with: loading takes the saved cores' multipliers with them, so the
    new setting would be silently ignored. ``built``: :func:`parametrizations` of the model
    before the load; ``model``: after it."""
    loaded = parametrizations(model)
    for name, (kind, scales) in built.items():
        if name not in loaded or loaded[name][1] == scales:
            continue
        saved_scales = loaded[name][1]
        saved = "plain" if all(s == 1.0 for s in saved_scales) else "balanced"
        raise CheckpointError(
            f"{path} was trained with the {saved} parametrization of its gated layers, and the "
            f"model is now built with the {kind} one ({name or '<model>'}: core multipliers "
            f"{list(saved_scales)} in the checkpoint, {list(scales)} now); resuming would keep "
            f"the saved one and ignore the new setting. Resume with parametrization="
            f"{saved!r}, or start without --resume.")
