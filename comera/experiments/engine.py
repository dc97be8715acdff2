"""The training engine: one loop for every task, dense or CoMERA, alone or data-parallel.

    task = PairTask(PairTaskConfig())
    record = train_model(task, "comera", tt=True, config=EngineConfig(), out=Path("runs/x"))

Per run it owns: the batches of each step (:class:`~comera.experiments.task.IndexStream`, a pure
function of seed and step), the optimizer and its learning-rate schedule (a pure function of the
step), the CoMERA stages (early: loss + lam * R; at ``steps_early`` the pruned ranks are truncated
and the late stage steers toward ``target_compression``), checkpoints (atomic, every
``checkpoint_every`` steps, at the stage boundary and at the end) and resumption from them, the
non-finite policy, evaluation on the validation split, and the record of the run (curves, ranks,
timings, sizes, test scores) that :mod:`comera.experiments.results` turns into files.

A resumed run restores model (at its truncated ranks), optimizer, trainer stage, step, RNG states
and history, and then sees exactly the batches it would have seen: it ends with the same
parameters as an uninterrupted run.
"""

from __future__ import annotations

import logging
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import comera
from comera.errors import CheckpointError, ConfigError, NonFiniteError, TrainingStopped
from comera.experiments.distributed import (
    World,
    average_gradients,
    barrier,
    broadcast_parameters_,
    current_world,
    mean_over_workers,
)
from comera.experiments.task import IndexStream, Task
from comera.layers import TTLinear, TTMLinear

log = logging.getLogger("comera.engine")

STAGES = ("early", "late", "both")
ON_NONFINITE = ("stop", "skip")


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

    def __post_init__(self) -> None:
        for name in ("steps_early", "steps_late", "warmup", "checkpoint_every", "max_skips",
                     "late_loss_slack"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)}; it must be >= 0.")
        for name in ("batch_size", "eval_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}; it must be >= 1.")
        for name in ("lr", "lr_gates"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)}; a learning rate is > 0.")
        if self.stage not in STAGES:
            raise ConfigError(f"stage={self.stage!r}; choose one of {', '.join(STAGES)}.")
        if self.on_nonfinite not in ON_NONFINITE:
            raise ConfigError(f"on_nonfinite={self.on_nonfinite!r}; choose one of "
                              f"{', '.join(ON_NONFINITE)}.")
        if not self.target_compression > 1:
            raise ConfigError(f"target_compression={self.target_compression}; it must be > 1 "
                              "(dense size / TT size).")

    @property
    def total_steps(self) -> int:
        """Steps of a whole run: early-stage steps plus late-stage steps."""
        return self.steps_early + self.steps_late


@dataclass
class RunRecord:
    """Everything measured in one run; plain data (it goes into checkpoints and JSON)."""

    name: str
    tt: bool
    steps: int = 0
    skipped: int = 0
    step_times: list = field(default_factory=list)  # seconds, training steps only
    train_curve: list = field(default_factory=list)  # (step, loss, objective, weighted)
    val_curve: list = field(default_factory=list)  # (step, {metric: value})
    ranks: list = field(default_factory=list)  # (step, {layer: [ranks]})
    stage_ends: dict = field(default_factory=dict)  # stage -> {"step", "val", "test", "sizes"}
    sizes: dict = field(default_factory=dict)  # at the end (see sizes_of)

    @property
    def step_ms(self) -> float:
        """Median time per training step in milliseconds (NaN when no step was timed)."""
        return statistics.median(self.step_times) * 1e3 if self.step_times else float("nan")


Progress = Callable[[dict[str, Any]], None]


def sizes_of(model: nn.Module) -> dict[str, float]:
    """Parameter counts: the whole model, its TT layers, its linear and embedding TT layers,
    each effective (at the gated ranks) and dense, with the compression ratios."""
    total = sum(p.numel() for p in model.parameters())
    out: dict[str, float] = {"parameters": total}
    if not any(True for _ in comera.tt_modules(model)):
        out.update(model_params=total, dense_model_params=total, tt_compression=1.0)
        return out
    out["model_params"] = comera.model_size(model)
    out["dense_model_params"] = comera.dense_size(model)
    for key, only in (("tt", comera.GatedTrain), ("linear", (TTLinear, TTMLinear)),
                      ("embedding", comera.TTEmbedding)):
        dense = comera.dense_size(model, only=only)
        if dense:
            params = comera.model_size(model, only=only)
            out[f"{key}_params"] = params
            out[f"{key}_dense_params"] = dense
            out[f"{key}_compression"] = dense / max(params, 1)
    return out


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, list | tuple):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch


def _lr_factor(step: int, warmup: int) -> float:
    return min(1.0, (step + 1) / warmup) if warmup else 1.0


class _Run:
    """State of one training run; ``train_model`` drives it."""

    def __init__(self, task: Task, name: str, tt: bool, config: EngineConfig, out: Path,
                 world: World, progress: Progress | None):
        self.task, self.name, self.tt, self.config, self.world = task, name, tt, config, world
        self.progress = progress
        self.device = torch.device(config.device)
        self.checkpoint_path = out / "checkpoints" / f"{name}.pt"
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        self.model = task.build_model(tt).to(self.device)
        broadcast_parameters_(self.model)
        if tt and not any(True for _ in comera.tt_modules(self.model)):
            raise ConfigError(f"task {task.name!r} built a model without TT layers for tt=True; "
                              "build_model(tt=True) must use comera's TT layers.")
        self.base_lr = {"cores": config.lr, "gates": config.lr_gates,
                        "other": config.lr if config.lr_other is None else config.lr_other}
        if tt:
            opt = comera.make_optimizer(self.model, comera.OptimizerConfig(
                config.lr, config.lr_gates, self.base_lr["other"]))
            lam = config.lam if config.stage != "late" else 0.0
            self.trainer = comera.CoMERATrainer(self.model, opt, lam, config.regularizer,
                                                config.max_grad_norm, average_gradients)
        else:
            opt = torch.optim.AdamW([{"params": list(self.model.parameters()), "lr": config.lr,
                                      "name": "other"}], weight_decay=0.0)
            self.base_lr["other"] = config.lr
            self.trainer = comera.DenseTrainer(self.model, opt, config.max_grad_norm,
                                               average_gradients)
        self.optimizer = opt
        self.stream = IndexStream(task.train_size(), config.batch_size, config.seed)
        self.record = RunRecord(name, tt)
        self.step = 0
        self.consecutive_skips = 0

    # -- stages -----------------------------------------------------------------------------
    def stages(self) -> list[tuple[str, int, int]]:
        """(stage, first step, end step) of this run. ``stage="late"`` trains the early steps
        without the rank regulariser (lam 0) before the late stage."""
        c = self.config
        if not self.tt:  # as many steps as the CoMERA run it is compared with
            return [("dense", 0, c.steps_early if c.stage == "early" else c.total_steps)]
        if c.stage == "early":
            return [("early", 0, c.steps_early)]
        return [("early", 0, c.steps_early), ("late", c.steps_early, c.total_steps)]

    def _start_late(self) -> None:
        target = comera.LateStage.from_ratio(
            self.model, self.config.target_compression,
            dense_reference=comera.dense_size(self.model, only=comera.GatedTrain),
        )
        # the target counts TT layers only; the model size the controller sees includes the rest
        # the step budget makes the stage land on the target by its end, whatever lr_gates is
        late = comera.LateStage(target.target_size + self._non_tt_params(), self._loss_target(),
                                steps=max(1, self.config.steps_late))
        report = self.trainer.start_late_stage(late)
        log.info("%s: late stage from step %d, target %.0f parameters; %s", self.name,
                 self.step, late.target_size, report)

    def _loss_target(self) -> float:
        recent = [loss for _, loss, _, _ in self.record.train_curve[-50:]]
        if not recent:
            raise ConfigError("the late stage needs a loss target from the early stage, but no "
                              "early step ran; set steps_early >= 1.")
        return statistics.fmean(recent) * (1.0 + self.config.late_loss_slack)

    def _non_tt_params(self) -> int:
        return comera.model_size(self.model) - comera.model_size(self.model, only=comera.GatedTrain)

    # -- one step -----------------------------------------------------------------------------
    def _set_lr(self) -> None:
        factor = _lr_factor(self.step, self.config.warmup)
        for group in self.optimizer.param_groups:
            group["lr"] = self.base_lr[group.get("name", "other")] * factor

    def train_step(self) -> None:
        batch = self.task.step_batch(self.stream, self.step, self.world.rank, self.world.size)
        batch = _to(batch, self.device)
        self._set_lr()
        start = time.perf_counter()
        loss = self.task.loss(self.model, batch)
        global_loss = mean_over_workers(float(loss.detach()), self.device)
        try:
            if not math.isfinite(global_loss):  # every worker sees it: all skip or stop alike
                raise comera.NonFiniteLossError(
                    f"step {self.step}: the loss is {global_loss} (mean over workers); the step "
                    "was not applied.")
            stats = self.trainer.step(loss, decision_loss=global_loss)
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
            with torch.no_grad():
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
        ranks = {n: list(m.ranks) for n, m in comera.tt_modules(self.model)}
        if ranks:
            self.record.ranks.append((self.step, ranks))
        last = self.record.train_curve[-1][1] if self.record.train_curve else float("nan")
        sizes = sizes_of(self.model)
        event = {"kind": "eval", "name": self.name, "stage": stage, "step": self.step,
                 "total": self.stages()[-1][2], "loss": last,
                 "metric": self.task.metric, "value": scores[self.task.metric],
                 "compression": sizes.get("tt_compression", 1.0),
                 "rank_total": sum(sum(r) for r in ranks.values())}
        log.info("%(name)s %(stage)s step %(step)d loss %(loss).4f val %(metric)s %(value).4f "
                 "compression %(compression).1fx", event)
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
        if not self.world.is_main:
            return
        self.checkpoint_path.parent.mkdir(parents=True, exist_ok=True)
        comera.save_checkpoint(
            self.checkpoint_path, self.model, self.optimizer,
            engine={"step": self.step, "trainer": self.trainer.state_dict(),
                    "rng_torch": torch.get_rng_state(), "rng_python": random.getstate(),
                    "record": asdict(self.record), "config": asdict(self.config),
                    "task": self.task.name, "tt": self.tt,
                    "consecutive_skips": self.consecutive_skips})
        log.info("%s: checkpoint at step %d -> %s", self.name, self.step, self.checkpoint_path)

    def resume(self) -> bool:
        """Load the run's checkpoint if there is one; False when starting fresh."""
        if not self.checkpoint_path.is_file():
            return False
        extra = comera.load_checkpoint(self.checkpoint_path, self.model, self.optimizer)
        state = extra.get("engine")
        if not isinstance(state, dict):
            raise CheckpointError(f"{self.checkpoint_path} was not written by the training "
                                  "engine (no 'engine' state); resume needs one of its "
                                  "checkpoints, or start without --resume.")
        if state["task"] != self.task.name or state["tt"] != self.tt:
            raise CheckpointError(
                f"{self.checkpoint_path} belongs to task {state['task']!r} (tt={state['tt']}), "
                f"not {self.task.name!r} (tt={self.tt}); point --out at that run's directory.")
        saved = {k: v for k, v in state["config"].items() if k not in ("device",)}
        mine = {k: v for k, v in asdict(self.config).items() if k not in ("device",)}
        changed = sorted(k for k in mine if saved.get(k) != mine[k] and k != "steps_late"
                         and k != "checkpoint_every")
        if changed:
            raise CheckpointError(
                f"{self.checkpoint_path} was trained with other settings ({', '.join(changed)}: "
                f"{[saved.get(k) for k in changed]} then, {[mine[k] for k in changed]} now); "
                "resume with the same settings.")
        self.trainer.load_state_dict(state["trainer"])
        self.step = int(state["step"])
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        torch.set_rng_state(state["rng_torch"])
        random.setstate(_as_tuple(state["rng_python"]))
        self.record = RunRecord(**state["record"])
        broadcast_parameters_(self.model)
        log.info("%s: resumed at step %d (stage %s)", self.name, self.step, self.trainer.stage)
        return True


def _as_tuple(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_as_tuple(v) for v in value)
    return value


def train_model(task: Task, name: str, tt: bool, config: EngineConfig, out: Path,
                resume: bool = False, progress: Progress | None = None,
                stop_after: int | None = None) -> tuple[nn.Module, RunRecord]:
    """Train one model of ``task`` (dense, or CoMERA with ``tt``); return it and its record.

    ``stop_after``: leave after this many steps of this call (a checkpoint is written first),
    e.g. to split a long run over sessions; ``resume`` continues from ``out``'s checkpoint.
    """
    world = current_world()
    run = _Run(task, name, tt, config, Path(out), world, progress)
    resumed = run.resume() if resume else False
    if not resumed and resume:
        log.info("%s: no checkpoint at %s; starting fresh", name, run.checkpoint_path)
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
