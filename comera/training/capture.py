"""Whole-step capture of a CoMERA training step: one compiled or graphed region per step.

    step = CapturedStep(trainer, lambda model, x, y: F.mse_loss(model(x), y), mode="compile")
    for x, y in batches:                   # fixed shapes (drop the last partial batch)
        loss = step(x, y)                  # forward, objective, backward, optimizer, gate masks
    trainer.start_late_stage(late)         # truncation: new shapes, the next call re-captures
    print(step.captures, step.reasons)     # 2, ['first call', 'parameters ... changed']

What runs inside the captured region (pure tensor work, no host reads):

- the forward and the loss (``loss_fn(model, *batch)``), the stage's objective: early
  ``L + lam * R``; late ``L + w * size_weight * soft_size / S_ref`` where the loss-or-size choice
  ``w`` is made on device from this step's loss and the live gate counts (the same rule as
  :meth:`comera.ranks.objective.LateStage.choose`), so no value leaves the device;
- backward, gradient clipping (``trainer.max_grad_norm``), the optimizer step;
- the gate masks: entries pruned before the step (``|g| <= tau``) are pinned at zero and their
  optimizer moments cleared, as :class:`~comera.training.trainers.CoMERATrainer` does.

What runs between captured steps, outside the region (reads a few gate vectors, one sync): the
non-finite loss check, the ``min_rank`` floor and the late stage's budget schedule (the
trainer's :class:`~comera.training.controller.RankController`: ``hold_floor_`` and
``follow_schedule_``, as its ``after_step`` runs them), which all change gates in place, so the
captured region sees them without re-capture. The eager trainer's restore of slices that crossed tau
below the size target in one step is left out: with a step budget the schedule lands the size.

Re-capture rule: the region is captured for one :class:`StepSignature` (each parameter's
identity, shape and dtype; the batch's shapes and dtypes; the stage). Anything else that changes
between steps is an in-place change to captured tensors and needs none. Physical truncation
(``trainer.start_late_stage`` / ``trainer.truncate``) replaces parameters and optimizer state,
so the next call captures again: once per run with the paper's schedule (the stage boundary).
A batch of another shape (a last partial batch) also re-captures: drop it.

Modes: ``"eager"`` runs the same body uncaptured (the reference), ``"compile"`` wraps it in
``torch.compile(mode=compile_mode, dynamic=False)`` (``"reduce-overhead"``: CUDA graphs under
the compiler on CUDA; on the CPU inductor alone), ``"graphs"`` (CUDA only) graphs the forward,
objective and backward with ``torch.cuda.graphs.make_graphed_callables`` and runs a fused
optimizer step and the masks eagerly after it. On CUDA, torch 2.11's CUDA-graph trees reject
the paper transformer's compiled step (docs/gpu.md; a small model's compiles); a failure raised
inside torch's CUDA-graph code comes out as :class:`~comera.errors.CaptureError` naming
``mode="graphs"``, the capture that works there.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from comera.errors import CaptureError, ConfigError, NonFiniteLossError
from comera.numbers import is_int
from comera.ranks.objective import rank_regularizer, soft_size
from comera.ranks.size import gated_layers, model_size
from comera.training.trainers import CoMERATrainer

__all__ = ["CAPTURE_MODES", "CapturedStep", "StepSignature"]

CaptureMode = Literal["eager", "compile", "graphs"]
CAPTURE_MODES: tuple[str, ...] = ("eager", "compile", "graphs")
LossFn = Callable[..., Tensor]
COMPILE_GRAPHS_FAILED = (
    "torch.compile(mode={compile_mode!r}) of the whole CoMERA step failed inside torch's CUDA "
    "graphs ({error}). torch 2.11's CUDA-graph trees reject the paper transformer's step "
    "in every set-up tried (docs/gpu.md). Use CapturedStep(..., mode='graphs'): the same CUDA "
    "graphs through torch.cuda.make_graphed_callables; or compile without CUDA graphs: "
    "compile_mode=None.")


def _raised_in_cudagraphs(exc: BaseException) -> bool:
    """True when ``exc`` was raised inside torch's CUDA-graph code (a frame of a file whose name
    holds ``cudagraph``), not in the model's own code."""
    return any("cudagraph" in frame.f_code.co_filename
               for frame, _ in traceback.walk_tb(exc.__traceback__))


@dataclass(frozen=True)
class StepSignature:
    """What a captured step is valid for: parameters (name, identity, shape, dtype), the batch's
    shapes and dtypes, and the stage. A different signature means a new capture."""

    params: tuple[tuple[str, int, tuple[int, ...], str], ...]
    batch: tuple[tuple[tuple[int, ...], str], ...]
    stage: str

    @classmethod
    def of(cls, model: nn.Module, batch: tuple[Tensor, ...], stage: str) -> StepSignature:
        params = tuple((name, id(p), tuple(p.shape), str(p.dtype))
                       for name, p in model.named_parameters())
        shapes = tuple((tuple(t.shape), str(t.dtype)) for t in batch)
        return cls(params, shapes, stage)

    def change_from(self, old: StepSignature | None) -> str:
        """Why a step captured for ``old`` cannot run for this signature (empty: it can)."""
        if old is None:
            return "first call"
        if old.stage != self.stage:
            return f"stage {old.stage} -> {self.stage}"
        if old.batch != self.batch:
            return f"batch {[s for s, _ in old.batch]} -> {[s for s, _ in self.batch]}"
        if old.params != self.params:
            changed = [n for (n, _, s, _), (_, _, s2, _) in zip(old.params, self.params,
                                                               strict=False) if s != s2]
            if len(old.params) != len(self.params) or changed:
                return f"parameter shapes changed ({len(changed)}: {', '.join(changed[:3])})"
            return "parameters replaced (same shapes)"
        return ""


def _tensor_size(model: nn.Module, constant: int) -> Tensor:
    """The model's size at the live ranks as a device tensor (no host read): per gated layer,
    the layout's size formula (:meth:`Layout.core_sizes_with`) with each bond counted as its
    gate entries above tau, plus the parameters outside the cores (``constant``)."""
    total: Tensor | None = None
    for _, layer in gated_layers(model):
        counts = [(g.detach().abs() > layer.tau).sum().to(g.dtype) for g in layer.gates]
        for term in layer.layout.core_sizes_with(counts):
            total = term if total is None else total + term
    assert total is not None  # CoMERATrainer refuses a model without TT layers
    return total + constant


class CapturedStep:
    """A :class:`CoMERATrainer`'s step, captured whole (see the module docstring).

    ``loss_fn(model, *batch)`` returns the scalar loss. ``autocast``: a dtype to run the forward
    and the objective under ``torch.autocast`` (e.g. ``torch.bfloat16``). ``check_every``: how
    often (in steps) the loss is read back to refuse a non-finite one; the other between-step
    decisions read the gates every step. ``backend``: ``torch.compile``'s backend (``"inductor"``;
    ``"aot_eager"`` traces the same graphs without generating code, for quick checks)."""

    def __init__(self, trainer: CoMERATrainer, loss_fn: LossFn, mode: CaptureMode = "compile",
                 compile_mode: str | None = "reduce-overhead", autocast: torch.dtype | None = None,
                 check_every: int = 1, backend: str = "inductor"):
        if not isinstance(trainer, CoMERATrainer):
            raise ConfigError(f"CapturedStep takes a comera.CoMERATrainer, got {trainer!r}.")
        if mode not in CAPTURE_MODES:
            raise ConfigError(f"mode {mode!r}; choose one of {', '.join(CAPTURE_MODES)}.")
        if trainer.grad_hook is not None or trainer.scaler is not None:
            raise ConfigError("CapturedStep runs no grad_hook and no GradScaler (float16): "
                              "capture a single-process bf16/fp32 step, or use trainer.step.")
        if not is_int(check_every):
            raise ConfigError(f"check_every={check_every!r}; give an int >= 1.")
        if mode == "graphs" and not torch.cuda.is_available():
            raise ConfigError("mode='graphs' captures CUDA graphs and needs a CUDA device; use "
                              "mode='compile' or 'eager' here.")
        self.trainer = trainer
        self.loss_fn = loss_fn
        self.mode = mode
        self.compile_mode = compile_mode
        self.autocast = autocast
        self.check_every = check_every
        self.backend = backend
        self.captures = 0
        self.reasons: list[str] = []
        self._signature: StepSignature | None = None
        self._run: Callable[..., Tensor] | None = None
        self._before: list[Tensor] = []
        self._constant = 0

    # -- the body ---------------------------------------------------------------------------
    def _pairs(self) -> list[tuple[float, Tensor]]:
        return [(layer.tau, g) for _, layer in gated_layers(self.trainer.model)
                for g in layer.gates]

    def _objective(self, *batch: Tensor) -> tuple[Tensor, Tensor]:
        """(objective, loss) of this step, on device: the stage's terms (module docstring)."""
        trainer, model = self.trainer, self.trainer.model
        device = batch[0].device.type if batch else "cpu"
        with torch.autocast(device, dtype=self.autocast, enabled=self.autocast is not None,
                            cache_enabled=False):  # a cast cache would outlive a graph
            loss = self.loss_fn(model, *batch)
            if trainer.stage == "early":
                total = loss if trainer.lam == 0 else (
                    loss + trainer.lam * rank_regularizer(model, trainer.regularizer))
                return total, loss
            late = trainer.late
            size = _tensor_size(model, self._constant)
            seen = loss.detach().float()
            loss_gap = (seen - late.target_loss) / seen.abs().clamp_min(1e-12)
            size_gap = (size - late.target_size) / size
            weigh = ((size > late.target_size) & (size_gap > loss_gap)).to(loss.dtype)
            reference = trainer.controller.size_reference
            if reference is None:  # as LateStage.objective: the size now
                reference = float(max(model_size(model), 1))
            return loss + weigh * late.size_weight * soft_size(model) / reference, loss

    def _finish(self, masks: list[Tensor]) -> None:
        """Clip, optimizer step, pin the gates pruned before the step (and their moments)."""
        trainer = self.trainer
        if trainer.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(trainer.model.parameters(), trainer.max_grad_norm)
        trainer.optimizer.step()
        with torch.no_grad():  # a few multi-tensor kernels, not one per gate and moment
            gates = [gate for _, gate in self._pairs()]
            held, keeps = list(gates), list(masks)
            for gate, keep in zip(gates, masks, strict=True):
                for value in trainer.optimizer.state.get(gate, {}).values():
                    if isinstance(value, Tensor) and value.shape == gate.shape:
                        held.append(value)
                        keeps.append(keep)
            if held:
                torch._foreach_mul_(held, keeps)

    def _masks(self) -> list[Tensor]:
        pairs = self._pairs()
        with torch.no_grad():
            if pairs:
                gates = [gate.detach() for _, gate in pairs]
                torch._foreach_copy_(self._before, gates)
                sizes = torch._foreach_abs(gates)
            else:
                sizes = []
            return [(size > tau).to(gate.dtype)
                    for (tau, gate), size in zip(pairs, sizes, strict=True)]

    def _body(self, *batch: Tensor) -> Tensor:
        masks = self._masks()
        self.trainer.optimizer.zero_grad(set_to_none=True)
        total, loss = self._objective(*batch)
        total.backward()
        self._finish(masks)
        return loss.detach()

    # -- capture ----------------------------------------------------------------------------
    def _capture(self, batch: tuple[Tensor, ...], reason: str) -> None:
        model = self.trainer.model
        self._before = [g.detach().clone() for _, g in self._pairs()]
        self._constant = model_size(model) - sum(m.num_parameters() - (
            m.bias.numel() if m.bias is not None else 0) for _, m in gated_layers(model))
        if self.mode == "eager":
            self._run = self._body
        elif self.mode == "compile":
            mode = self.compile_mode if self.backend == "inductor" else None
            self._run = torch.compile(self._body, backend=self.backend, dynamic=False, mode=mode)
        else:
            self._run = self._graphed(batch)
        self.captures += 1
        self.reasons.append(reason)

    def _graphed(self, batch: tuple[Tensor, ...]) -> Callable[..., Tensor]:
        step = self

        class Objective(nn.Module):  # its parameters are the model's: graphed with it
            def __init__(self) -> None:
                super().__init__()
                self.model = step.trainer.model

            def forward(self, *xs: Tensor) -> tuple[Tensor, Tensor]:
                total, loss = step._objective(*xs)
                return total, loss.detach()  # only the objective is backpropagated

        samples = tuple(t.detach().clone() for t in batch)
        graphed = torch.cuda.graphs.make_graphed_callables(Objective(), samples)

        def run(*xs: Tensor) -> Tensor:
            masks = self._masks()
            self.trainer.optimizer.zero_grad(set_to_none=True)
            total, loss = graphed(*xs)
            total.backward()
            self._finish(masks)
            return loss.detach()

        return run

    # -- one step ---------------------------------------------------------------------------
    def __call__(self, *batch: Tensor) -> Tensor:
        """One training step on ``batch``; returns the loss (a detached device tensor)."""
        trainer = self.trainer
        signature = StepSignature.of(trainer.model, batch, trainer.stage)
        reason = signature.change_from(self._signature)
        if reason:
            self._capture(batch, reason)
            self._signature = signature
        try:
            loss = self._run(*batch)
        except Exception as exc:
            if self.mode == "compile" and _raised_in_cudagraphs(exc):
                first = str(exc).splitlines()[0][:200] if str(exc) else ""
                error = f"{type(exc).__name__}: {first}"
                raise CaptureError(COMPILE_GRAPHS_FAILED.format(
                    compile_mode=self.compile_mode, error=error)) from exc
            raise
        if trainer.steps % self.check_every == 0 and not bool(torch.isfinite(loss).all()):
            raise NonFiniteLossError(
                f"step {trainer.steps}: the loss is {float(loss)}; the update was applied by "
                "the captured step (restore the last checkpoint and lower the learning rates).")
        self._between_steps()
        trainer.steps += 1
        return loss

    def _between_steps(self) -> None:
        """The decisions outside the captured region: the rank floor and the late budget."""
        trainer = self.trainer
        trainer.controller.hold_floor_(self._before, trainer.optimizer)
        trainer.controller.follow_schedule_(trainer.optimizer)
