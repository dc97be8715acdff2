"""The training engine: one loop for every task, dense or CoMERA, alone or data-parallel.

    task = CodePairTask(CodePairTaskConfig())
    model, record = train_model(task, "comera", EngineConfig(format="tt"), Path("runs/x"))
    dense, _ = train_model(task, "dense", EngineConfig(format="dense"), Path("runs/x"))

Per run it owns: the batches of each step (:class:`~comera.experiments.task.IndexStream`, a pure
function of seed and step), the optimizer and its learning-rate schedule (a pure function of the
step), the CoMERA stages (early: loss + lam * R; at ``steps_early`` the pruned ranks are truncated
and the late stage steers toward ``target_compression``), checkpoints (atomic, every
``checkpoint_every`` steps, at the stage boundary and at the end) and resumption from them, the
non-finite policy, evaluation on the validation split, and the record of the run (curves, ranks,
timings, sizes, test scores) that :mod:`comera.experiments.results` turns into files.

A resumed run restores model (at its truncated ranks), optimizer, trainer stage, step, RNG states
and history, and then sees exactly the batches it would have seen: it ends with the same
parameters as an uninterrupted run. The settings come in groups, each checking its own fields
(:mod:`comera.experiments.engine_config`); the checks against the machine and the task live in
:mod:`comera.experiments.checks`, the optimizer and schedule in
:mod:`comera.experiments.optim_schedule`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

import comera
from comera import (
    CheckpointError,
    ConfigError,
    NonFiniteError,
    NonFiniteGradientError,
    TrainingStopped,
)
from comera.batches import to_device
from comera.experiments.checks import (
    MAX_INT,
    check_device,
    check_int,
    check_kept_parametrization,
    check_settings,
    check_task,
    parametrizations,
)
from comera.experiments.distributed import (
    World,
    barrier,
    broadcast_parameters_,
    current_world,
    load_run_checkpoint,
    mean_over_workers,
    prepare_model_,
    save_run_checkpoint,
)
from comera.experiments.engine_config import (
    GROUPS,
    RESULT_FREE,
    LateSettings,
    OptimSettings,
    RankSettings,
    RunSettings,
    RuntimeSettings,
)
from comera.experiments.optim_schedule import base_rates, run_optimizer
from comera.experiments.run_state import (
    RunRecord,
    check_engine_state,
    current_engine_state,
    engine_state_format,
    run_checkpoint_format,
)
from comera.experiments.rundir import hold_run_directory
from comera.experiments.task import IndexStream, Task, build_task_model
from comera.formats.tt_flag import format_from_tt
from comera.ranks.allocate import check_chain_format
from comera.ranks.size import dense_size
from comera.training.trainers import pick_threads

__all__ = ["EngineConfig", "Progress", "RunRecord", "check_device", "check_settings",
           "check_task", "engine_state_format", "run_checkpoint_format", "sizes_of",
           "train_model"]

log = logging.getLogger("comera.engine")

# the groups in reverse: a dataclass lists the fields of its last base first, so EngineConfig's
# fields (its signature, asdict, repr) read optim, run, ranks, late, runtime
@dataclass(frozen=True)
class EngineConfig(RuntimeSettings, LateSettings, RankSettings, RunSettings, OptimSettings):
    """How to train; the task decides what. The settings come in five groups
    (:mod:`comera.experiments.engine_config`), each checked by its own class:

    - ``config.optim`` (:class:`~comera.experiments.engine_config.OptimSettings`): steps, batch,
      learning rates, warm-up, optimizer, schedule, clipping;
    - ``config.run`` (:class:`~comera.experiments.engine_config.RunSettings`): ``stage`` (the
      CoMERA stages to run), ``format`` (the layer kind), seed, evaluation and checkpoint
      cadence, the non-finite policy;
    - ``config.ranks`` (:class:`~comera.experiments.engine_config.RankSettings`): the early
      stage's regulariser, its weight and size target;
    - ``config.late`` (:class:`~comera.experiments.engine_config.LateSettings`): the late
      stage's size and loss targets, allocation and landing;
    - ``config.runtime`` (:class:`~comera.experiments.engine_config.RuntimeSettings`): device,
      precision, compile, memory, threads, block checkpointing, FSDP.

    Made flat, ``EngineConfig(lr=3e-4, target_compression=20)``, or from groups,
    ``EngineConfig.from_groups(optim=..., late=...)``; every setting reads flat
    (``config.lr``) and changes with ``dataclasses.replace(config, lr=...)``. An EngineConfig is
    each of its groups, so a function that needs one group takes the config too."""

    def __post_init__(self) -> None:
        """Check every setting (type, range, finiteness), group by group, before anything is
        built; then the settings of two groups together."""
        OptimSettings.__post_init__(self)
        RunSettings.__post_init__(self)
        RankSettings.__post_init__(self)
        LateSettings.__post_init__(self)
        RuntimeSettings.__post_init__(self)
        if self.late_allocation == "spectrum" and self.compressed:  # read from chains' spectra
            try:
                check_chain_format(self.format)
            except ConfigError as exc:
                raise ConfigError(f"late_allocation='spectrum' with {exc}") from None

    @classmethod
    def from_groups(cls, *, optim: OptimSettings | None = None, run: RunSettings | None = None,
                    ranks: RankSettings | None = None, late: LateSettings | None = None,
                    runtime: RuntimeSettings | None = None) -> EngineConfig:
        """The config of these groups, each left out one at its defaults."""
        given = {"optim": optim, "run": run, "ranks": ranks, "late": late, "runtime": runtime}
        settings: dict[str, Any] = {}
        for name, group in given.items():
            if group is None:
                continue
            kind = GROUPS[name]
            if not isinstance(group, kind):
                raise ConfigError(f"from_groups({name}={group!r}): give a {kind.__name__} "
                                  "(or None: its defaults).")
            settings.update((f.name, getattr(group, f.name)) for f in fields(kind))
        return cls(**settings)

    def _group(self, kind: type) -> Any:
        return kind(**{f.name: getattr(self, f.name) for f in fields(kind)})

    @property
    def optim(self) -> OptimSettings:
        """The optimisation schedule: steps, batch, learning rates, warm-up, optimizer,
        schedule, clipping."""
        return self._group(OptimSettings)

    @property
    def run(self) -> RunSettings:
        """The run: stages, layer kind, seed, evaluation and checkpoint cadence, non-finite
        policy."""
        return self._group(RunSettings)

    @property
    def ranks(self) -> RankSettings:
        """The early stage's rank objective: regulariser, weight, size target."""
        return self._group(RankSettings)

    @property
    def late(self) -> LateSettings:
        """The late stage: size and loss targets, allocation, landing."""
        return self._group(LateSettings)

    @property
    def runtime(self) -> RuntimeSettings:
        """Device, precision, compile, memory, threads, block checkpointing, FSDP."""
        return self._group(RuntimeSettings)


# called with each event: {"kind": "step" | "eval", "name", "stage", "step", "total", "loss"
# (None at an evaluation before the first step), "compression" (the gated layers', as the
# late stage's target counts it); eval: "metric", "value",
# "rank_total"}
Progress = Callable[[dict[str, Any]], None]


def sizes_of(model: nn.Module) -> dict[str, float]:
    """Parameter counts: the whole model, its TT layers, its linear and embedding TT layers,
    each effective (at the gated ranks) and dense, with the compression ratios."""
    total = sum(p.numel() for p in model.parameters())
    out: dict[str, float] = {"parameters": total}
    if not any(True for _ in comera.gated_layers(model)):
        out.update(model_params=total, dense_model_params=total, tt_compression=1.0)
        return out
    out["model_params"] = comera.model_size(model)
    out["dense_model_params"] = dense_size(model)
    for key, only in (("tt", comera.GatedLayer), ("linear", comera.GatedLinear),
                      ("embedding", comera.GatedEmbedding)):
        dense = dense_size(model, only=only)
        if dense:
            params = comera.model_size(model, only=only)
            out[f"{key}_params"] = params
            out[f"{key}_dense_params"] = dense
            out[f"{key}_compression"] = dense / max(params, 1)
    return out


class _Run:
    """State of one training run; ``train_model`` drives it."""

    def __init__(self, task: Task, name: str, config: EngineConfig, out: Path,
                 world: World, progress: Progress | None,
                 build: Callable[[], nn.Module] | None = None, start_step: int = 0):
        self.task, self.name, self.config, self.world = task, name, config, world
        self.progress = progress
        self.device = check_device(config.device)
        self.checkpoint_path = out / "checkpoints" / f"{name}.pt"
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        built = build_task_model(task, config.format) if build is None else build()
        if not isinstance(built, nn.Module):
            raise ConfigError(f"build() gave a {type(built).__name__}; it must return the "
                              "nn.Module to train.")
        self.model = built.to(self.device)
        broadcast_parameters_(self.model)
        _trade_time_for_memory_(self.model, config.runtime, task.name)
        if config.compressed and not any(True for _ in comera.gated_layers(self.model)):
            raise ConfigError(f"the model of task {task.name!r} has no gated layers for a "
                              f"CoMERA run (format {config.format!r}); build_model(format) (or "
                              "build) must use comera's layers of that format.")
        hook, clip = prepare_model_(self.model, config.fsdp, config.max_grad_norm)
        self.base_lr = base_rates(config)
        opt = run_optimizer(self.model, config)
        if config.compressed:
            ranks = config.ranks
            lam = ranks.lam if config.stage != "late" else 0.0
            self.trainer = comera.CoMERATrainer(
                self.model, opt, lam, ranks.regularizer, clip, hook,
                early=ranks.early_stage(self.model, config.steps_early))
        else:
            self.trainer = comera.DenseTrainer(self.model, opt, clip, hook)
        self.optimizer = opt
        self.scaler = (torch.amp.GradScaler(self.device.type) if config.precision == "fp16"
                       else None)
        self.trainer.scaler = self.scaler
        # the training forward; checkpoints, sizes and evaluation use the model itself
        self.forward_model = torch.compile(self.model) if config.compile else self.model
        self.stream = IndexStream(task.train_size(), config.batch_size, config.seed)
        self.record = RunRecord(name, config.format)
        self.step = start_step
        self.consecutive_skips = 0
        self.resumed_threads: int | None = None  # the CPU thread count a checkpoint was run at

    # -- stages -----------------------------------------------------------------------------
    def stages(self) -> list[tuple[str, int, int]]:
        """(stage, first step, end step) of this run. ``stage="late"`` trains the early steps
        without the rank regulariser (lam 0) before the late stage."""
        c = self.config
        if not c.compressed:  # as many steps as the CoMERA run it is compared with
            return [("dense", 0, c.steps_early if c.stage == "early" else c.total_steps)]
        if c.stage == "early":
            return [("early", 0, c.steps_early)]
        return [("early", 0, c.steps_early), ("late", c.steps_early, c.total_steps)]

    def _start_late(self) -> None:
        settings = self.config.late
        recent = [loss for _, loss, _, _ in self.record.train_curve[-50:]]
        late = settings.late_stage(self.model, settings.loss_target(recent),
                                   steps=max(1, self.config.steps_late))
        report = self.trainer.start_late_stage(late)
        log.info("%s: late stage from step %d, target %.0f parameters; %s", self.name,
                 self.step, late.target_size, report)

    # -- one step -----------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        return self.config.runtime.autocast(self.device)

    def _set_lr(self) -> None:
        factor = self.config.optim.lr_factor(self.step, self.stages()[-1][2])
        for group in self.optimizer.param_groups:
            group["lr"] = self.base_lr[group.get("name", "other")] * factor

    def train_step(self) -> None:
        began = time.perf_counter()
        try:
            self._train_step()
        finally:
            self.record.train_seconds += time.perf_counter() - began

    def _train_step(self) -> None:
        batch = self.task.step_batch(self.stream, self.step, self.world.rank, self.world.size)
        batch = to_device(batch, self.device, non_blocking=True)
        self._set_lr()
        start = time.perf_counter()
        with self._autocast():
            loss = self.task.loss(self.forward_model, batch)
        global_loss = mean_over_workers(float(loss.detach()), self.device)
        try:
            if not math.isfinite(global_loss):  # every worker sees it: all skip or stop alike
                raise comera.NonFiniteLossError(
                    f"step {self.step}: the loss is {global_loss} (mean over workers); the step "
                    "was not applied.")
            stats = self.trainer.step(loss, decision_loss=global_loss)
        except NonFiniteGradientError as exc:
            if self.scaler is None:
                self._on_nonfinite(exc)
            else:  # fp16 overflow: the scaler lowered its scale, as GradScaler.step skips
                self.optimizer.zero_grad(set_to_none=True)
                self.record.skipped += 1
            self.step += 1
            return
        except NonFiniteError as exc:
            self._on_nonfinite(exc)
            self.step += 1
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.record.step_times.append(time.perf_counter() - start)
        self.consecutive_skips = 0
        # the regulariser / size term is the same on every worker; the loss is averaged
        objective = global_loss + (stats.objective - stats.loss)
        self.record.train_curve.append((self.step, global_loss, objective, stats.weighted))
        self.step += 1
        if self.progress is not None:
            self.progress({"kind": "step", "name": self.name, "stage": stats.stage,
                           "step": self.step, "total": self.stages()[-1][2], "loss": global_loss,
                           "compression": stats.compression})

    def _on_nonfinite(self, exc: NonFiniteError) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.record.skipped += 1
        self.consecutive_skips += 1
        kept = (f"the last good checkpoint is {self.checkpoint_path}"
                if self.checkpoint_path.is_file() else "no checkpoint was written yet")
        if self.config.on_nonfinite == "stop" or self.consecutive_skips > self.config.max_skips:
            why = ("on_nonfinite='stop'" if self.config.on_nonfinite == "stop"
                   else f"{self.consecutive_skips} steps in a row were skipped")
            raise TrainingStopped(f"{self.name}: {exc} Stopped ({why}); {kept}. Lower the "
                                  "learning rates or set max_grad_norm, then resume.") from exc
        log.warning("%s: skipped step %d: %s", self.name, self.step, exc)

    # -- evaluation and bookkeeping --------------------------------------------------------------
    def evaluate(self, split: str) -> dict[str, float]:
        self.model.eval()
        try:
            with torch.no_grad(), self._autocast():
                scores = self.task.evaluate(self.model, split)
        finally:
            self.model.train()
        missing = {"loss", self.task.metric} - set(scores)
        if missing:
            raise ConfigError(f"task {self.task.name!r}: evaluate() returned {sorted(scores)}; "
                              f"it must include {sorted(missing)}.")
        return {k: float(v) for k, v in scores.items()}

    def observe(self, stage: str) -> None:
        scores = self.evaluate("val")
        self.record.val_curve.append((self.step, scores))
        self.record.val_seconds.append(self.record.train_seconds)
        ranks = {n: list(m.ranks) for n, m in comera.gated_layers(self.model)}
        if ranks:
            self.record.ranks.append((self.step, ranks))
        # the last training loss; None before the first step (there is none yet)
        last = self.record.train_curve[-1][1] if self.record.train_curve else None
        sizes = sizes_of(self.model)
        event = {"kind": "eval", "name": self.name, "stage": stage, "step": self.step,
                 "total": self.stages()[-1][2], "loss": last,
                 "metric": self.task.metric, "value": scores[self.task.metric],
                 "compression": sizes.get("tt_compression", 1.0),
                 "rank_total": sum(sum(r) for r in ranks.values())}
        log.info("%s %s step %d%s val %s %.4f compression %.1fx", self.name, stage, self.step,
                 "" if last is None else f" loss {last:.4f}", self.task.metric,
                 event["value"], event["compression"])
        if self.progress is not None:
            self.progress(event)

    def end_stage(self, stage: str) -> None:
        last_step, last_val = self.record.val_curve[-1]
        val = last_val if last_step == self.step else self.evaluate("val")
        self.record.stage_ends[stage] = {"step": self.step, "val": val,
                                         "test": self.evaluate("test"),
                                         "sizes": sizes_of(self.model)}

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self) -> None:
        if not (self.world.is_main or self.config.fsdp):  # FSDP: every worker gathers
            return
        if self.world.is_main:
            self.checkpoint_path.parent.mkdir(parents=True, exist_ok=True)
        save_run_checkpoint(
            self.checkpoint_path, self.model, self.optimizer, self.config.fsdp,
            engine={"step": self.step, "trainer": self.trainer.state_dict(),
                    "rng_torch": torch.get_rng_state(), "rng_python": random.getstate(),
                    "record": asdict(self.record), "config": asdict(self.config),
                    "task": self.task.name, "format": self.config.format,
                    "consecutive_skips": self.consecutive_skips,
                    "threads": torch.get_num_threads(),
                    "scaler": self.scaler.state_dict() if self.scaler is not None else None})
        log.info("%s: checkpoint at step %d -> %s", self.name, self.step, self.checkpoint_path)

    def _check_format(self, saved: str) -> None:
        """Refuse to resume a checkpoint of the layer kind ``saved`` as a run of another."""
        if saved != self.config.format:
            raise CheckpointError(
                f"{self.checkpoint_path} belongs to task {self.task.name!r} (format {saved!r}), "
                f"not {self.task.name!r} (format {self.config.format!r}); resume it with "
                f"format={saved!r} (comera train --format {saved}), or point --out at another "
                "run's directory.")

    def resume(self) -> bool:
        """Load the run's checkpoint if there is one; False when starting fresh."""
        if not self.checkpoint_path.is_file():
            return False
        built = parametrizations(self.model)
        try:
            extra = load_run_checkpoint(self.checkpoint_path, self.model, self.optimizer,
                                        self.config.fsdp)
        except CheckpointError as exc:  # a model of another format does not fit: say which
            try:
                saved = run_checkpoint_format(self.checkpoint_path)
            except CheckpointError:
                raise exc from None  # not even an engine state: the load's own error
            self._check_format(saved)
            raise
        check_kept_parametrization(built, self.model, self.checkpoint_path)
        state = extra.get("engine")
        if not isinstance(state, dict):
            raise CheckpointError(f"{self.checkpoint_path} was not written by the training "
                                  "engine (no 'engine' state); resume needs one of its "
                                  "checkpoints, or start without --resume.")
        state = current_engine_state(state, self.checkpoint_path)
        check_engine_state(state, self.checkpoint_path)
        if state["task"] != self.task.name:
            raise CheckpointError(
                f"{self.checkpoint_path} belongs to task {state['task']!r} (format "
                f"{state['format']!r}), not {self.task.name!r} (format "
                f"{self.config.format!r}); point --out at that run's directory.")
        self._check_format(state["format"])
        defaults = asdict(EngineConfig())  # settings a checkpoint predates have their default
        # settings a resume may change: the runtime's that leave the results unchanged, a
        # longer or shorter late stage, another checkpoint cadence
        free = (*RESULT_FREE, "steps_late", "checkpoint_every")
        saved = {k: v for k, v in {**defaults, **state["config"]}.items() if k not in free}
        mine = {k: v for k, v in asdict(self.config).items() if k not in free}
        changed = sorted(k for k in mine if saved.get(k) != mine[k])
        if changed:
            raise CheckpointError(
                f"{self.checkpoint_path} was trained with other settings ({', '.join(changed)}: "
                f"{[saved.get(k) for k in changed]} then, {[mine[k] for k in changed]} now); "
                "resume with the same settings.")
        try:
            self.trainer.load_state_dict(state["trainer"])
            self.step = int(state["step"])
            self.consecutive_skips = int(state.get("consecutive_skips", 0))
            self.resumed_threads = state.get("threads")
            if self.scaler is not None and state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
            torch.set_rng_state(state["rng_torch"])
            random.setstate(_as_tuple(state["rng_python"]))
            self.record = RunRecord.from_dict(state["record"], state["format"])
        except (KeyError, AttributeError, TypeError, ValueError, IndexError,
                RuntimeError) as exc:  # an edited state that passed its (recomputed) checksum
            raise CheckpointError(f"{self.checkpoint_path}: its engine state cannot be "
                                  f"restored ({type(exc).__name__}: {exc}); the file is "
                                  "damaged or was edited. Start without --resume.") from None
        if not self.config.fsdp:  # FSDP: every worker loaded the same file into its shard
            broadcast_parameters_(self.model)
        log.info("%s: resumed at step %d (stage %s)", self.name, self.step, self.trainer.stage)
        return True


def _trade_time_for_memory_(model: nn.Module, runtime: RuntimeSettings, task: str) -> None:
    """Set what ``model``'s gated layers keep for the backward (``runtime.memory``) and whether
    its encoder blocks recompute (``runtime.checkpoint_blocks``): time for memory, the results
    unchanged."""
    for _, layer in comera.gated_layers(model):
        if layer.memory != runtime.memory:
            layer.memory = runtime.memory
    if runtime.checkpoint_blocks:
        if not hasattr(model, "checkpoint_blocks"):
            raise ConfigError(
                f"checkpoint_blocks=True, but task {task!r} builds a {type(model).__name__}, "
                "which has no encoder blocks to checkpoint (the transformer models have: "
                "PairClassifier, MaskedLM); train it without checkpoint_blocks.")
        model.checkpoint_blocks = True


def _set_threads(run: _Run, config: EngineConfig) -> None:
    """CPU threads of the run: ``config.threads``, else the count a resumed checkpoint ran
    at, else (alone, on the CPU, with more than one thread) the faster of 1 and the current
    count over a few forward+backward passes of the next batch
    (:func:`comera.training.trainers.pick_threads`). The passes leave no trace: gradients are
    dropped and the RNG states restored, so the run's numbers do not change."""
    if run.device.type != "cpu":
        return
    if config.threads:
        torch.set_num_threads(config.threads)
        return
    if isinstance(run.resumed_threads, int) and run.resumed_threads >= 1:
        # a resumed run keeps the count it was checkpointed with: CPU reductions split work by
        # thread, so another count could change the last bits and break bit-exact resume
        torch.set_num_threads(run.resumed_threads)
        return
    if run.world.size > 1 or torch.get_num_threads() == 1:
        return
    batch = to_device(run.task.step_batch(run.stream, run.step, run.world.rank, run.world.size),
                      run.device, non_blocking=True)
    rng = torch.get_rng_state(), random.getstate()

    def probe() -> None:
        with run._autocast():
            run.task.loss(run.forward_model, batch).backward()

    try:
        pick_threads(probe)
    finally:
        run.model.zero_grad(set_to_none=True)
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])


def _as_tuple(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_as_tuple(v) for v in value)
    return value


# train_model's arguments after ``out`` in the order of the call of before (task, name, tt,
# config, out, resume, progress, stop_after, build, start_step)
_LEGACY_ORDER = ("resume", "progress", "stop_after", "build", "start_step")


def train_model(task: Task, name: str, config: EngineConfig, out: Path | str, *legacy: Any,
                resume: bool = False, progress: Progress | None = None,
                stop_after: int | None = None, build: Callable[[], nn.Module] | None = None,
                start_step: int = 0, tt: bool | None = None) -> tuple[nn.Module, RunRecord]:
    """Train one model of ``task``, of the layer kind ``config.format`` (a registered format: a
    CoMERA run; ``"dense"``: the dense baseline); return it and its record.

    ``stop_after``: leave after this many steps of this call (a checkpoint is written first),
    e.g. to split a long run over sessions; ``resume`` continues from ``out``'s checkpoint if
    there is one (and starts fresh otherwise). ``build``: how to make the model instead of the
    task's ``build_model`` (called once the run has seeded the RNG, as ``build_model`` is; e.g. a
    model at another rank or of other sizes, or a copy of one trained up to ``start_step``);
    ``start_step``: the step the run starts at, its batches, schedule and stages continuing
    from there (a run started inside the late stage starts it at once, on
    ``late_target_loss``). The settings are checked before anything is
    built, and ``out`` is held for the call (:func:`~comera.experiments.rundir.hold_run_directory`):
    a second run on it is refused at once.

    The call of before, ``train_model(task, name, tt, config, out, ...)`` or ``tt=`` (True: the
    run of ``config.format``; False: the dense one), works until 0.3.0 with a
    DeprecationWarning naming this one.
    """
    if isinstance(config, bool) or tt is not None or legacy:
        config, out, options = _legacy_call(config, out, legacy, tt, dict(
            resume=resume, progress=progress, stop_after=stop_after, build=build,
            start_step=start_step))
        resume, progress, stop_after, build, start_step = (options[k] for k in _LEGACY_ORDER)
    if not isinstance(config, EngineConfig):
        raise ConfigError(f"train_model(task, name, config, out): config is a "
                          f"{type(config).__name__}, not an EngineConfig; the run's layer kind "
                          "is config.format.")
    check_settings(config, world_size=current_world().size)
    check_task(task, config)
    _check_start(config, build, start_step)
    with _holding(out):
        return _train(task, name, config, Path(out), resume, progress, stop_after, build,
                      start_step)


def _legacy_call(config: Any, out: Any, legacy: tuple, tt: bool | None,
                 options: dict[str, Any]) -> tuple[EngineConfig, Any, dict[str, Any]]:
    """(config, out, options) of a call of before: ``(task, name, tt, config, out, resume,
    ...)`` positionally, or with ``tt=``; the flag becomes ``config.format``, with a
    DeprecationWarning naming the call of now."""
    if isinstance(config, bool):  # the flag in the third place: everything after it moves
        if tt is not None:
            raise ConfigError("train_model: tt given twice (third argument and tt=); give "
                              "train_model(task, name, config, out) with config.format.")
        tt, config, (out, *legacy) = config, out, (legacy or (None,))
    if len(legacy) > len(_LEGACY_ORDER):
        raise ConfigError(f"train_model takes {len(_LEGACY_ORDER)} arguments after out, "
                          f"got {len(legacy)}; give them by name: {', '.join(_LEGACY_ORDER)}.")
    for key, value in zip(_LEGACY_ORDER, legacy, strict=False):
        options[key] = value
    if out is None:
        raise ConfigError("train_model(task, name, config, out): out, the run directory, is "
                          "missing.")
    if tt is not None:
        if not isinstance(config, EngineConfig):
            raise ConfigError(f"train_model(task, name, config, out): config is a "
                              f"{type(config).__name__}, not an EngineConfig.")
        format = format_from_tt(tt, config.format, "train_model(task, name, replace(config, "
                                "format={}), out), the kind in config.format", stacklevel=4)
        if format != config.format:
            config = replace(config, format=format)
    return config, out, options


def _check_start(config: EngineConfig, build: Callable[[], nn.Module] | None,
                 start_step: int) -> None:
    """``build`` is callable; a start step lies inside the run, and one inside the late stage
    has a loss target that needs no early losses."""
    check_int("start_step", start_step, 0, MAX_INT)
    if build is not None and not callable(build):
        raise ConfigError(f"build={build!r}; give a function returning the model (or None: the "
                          "task builds it).")
    end = config.steps_early if config.stage == "early" else config.total_steps
    if start_step >= end:
        raise ConfigError(f"start_step={start_step}: the run ends at step {end}; start before "
                          "its end.")
    late = config.compressed and config.stage != "early" and config.steps_late
    if late and start_step >= config.steps_early and config.late_target_loss is None:
        raise ConfigError(f"start_step={start_step} starts inside the late stage, whose loss "
                          "target comes from the early stage's last losses; set "
                          "late_target_loss.")


def _holding(out: Path | str) -> contextlib.AbstractContextManager:
    """The run directory, held by the main worker (the only one that writes into it)."""
    if current_world().is_main:
        return hold_run_directory(out)
    return contextlib.nullcontext(Path(out))


def _train(task: Task, name: str, config: EngineConfig, out: Path, resume: bool,
           progress: Progress | None, stop_after: int | None,
           build: Callable[[], nn.Module] | None,
           start_step: int) -> tuple[nn.Module, RunRecord]:
    """``train_model`` inside a held run directory."""
    world = current_world()
    run = _Run(task, name, config, Path(out), world, progress, build, start_step)
    resumed = run.resume() if resume else False
    if not resumed and resume:
        log.info("%s: no checkpoint at %s; starting fresh", name, run.checkpoint_path)
    _set_threads(run, config)
    budget = math.inf if stop_after is None else stop_after
    taken = 0
    for stage, first, end in run.stages():
        if run.step >= end:
            continue
        if stage == "late" and run.trainer.stage == "early":
            run._start_late()
            run.save()  # the stage boundary: truncated shapes are on disk
        while run.step < end:
            if taken >= budget:
                run.save()
                barrier()
                return run.model, run.record
            if run.step == first or run.step % config.eval_every == 0:
                run.observe(stage)
            run.train_step()
            taken += 1
            if config.checkpoint_every and run.step % config.checkpoint_every == 0:
                run.save()
        run.observe(stage)
        run.end_stage(stage)
    run.record.steps = run.step
    run.record.sizes = sizes_of(run.model)
    run.save()
    barrier()
    return run.model, run.record
