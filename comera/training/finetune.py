"""Fine-tuning a converted model: one recipe, chosen by measurement, and a short loop.

    comera.convert_(model, target_compression=4, allocation="sensitivity", calibration=batches)
    recipe = comera.FinetuneRecipe(pretrain_lr=1e-3, steps=150)   # the rate you pretrained at
    comera.finetune(model, batches, recipe=recipe)                 # your own batches, or:
    comera.hold_gates_(model)                                      # HuggingFace Trainer
    Trainer(model, TrainingArguments("out", **recipe.hf_training_args()), train_dataset=data)

The recipe is what the conversion studies fine-tuned with (docs/finetune.md cites the figures):
plain AdamW at :data:`LR_FACTOR` times the pretraining learning rate, a linear warm-up over
:data:`WARMUP_FRACTION` of the steps, then a constant rate, no weight decay, gradients clipped
to norm 1, and the rank gates held (frozen: ``requires_grad`` off), so the ranks the conversion
chose stay as they are and only the cores and the unconverted parameters move.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from comera.batches import to_device
from comera.errors import ConfigError
from comera.numbers import is_int
from comera.ranks.size import gated_layers
from comera.training.trainers import DenseTrainer, OptimizerConfig, param_groups

log = logging.getLogger("comera.training.finetune")

__all__ = ["LR_FACTOR", "SCHEDULES", "WARMUP_FRACTION", "FinetuneRecipe", "finetune",
           "hold_gates_", "lr_factor"]

#: The fine-tune's learning rate as a multiple of the pretraining's: the one factor closest to
#: every measured arm's best (plain and balanced cores, every allocation, 2x-8x). The one number
#: to change when new measurements say so; docs/finetune.md cites the figures it was set from.
LR_FACTOR = 1.0

#: The share of the fine-tune's steps spent warming the rate up linearly (at least one step).
WARMUP_FRACTION = 0.1

#: The rate after the warm-up: held (``"constant"``, what was measured) or half a cosine down to
#: 0 at the last step (``"cosine"``).
SCHEDULES = ("constant", "cosine")

# the HuggingFace ``lr_scheduler_type`` of each schedule
_HF_SCHEDULER = {"constant": "constant_with_warmup", "cosine": "cosine"}

#: ``loss_fn(output, target) -> scalar tensor``: the loss of an ``(x, y)`` batch from
#: ``model(x)`` and ``y``; of a dict batch from the output and the batch.
LossFn = Callable[[Any, Any], Tensor]


def lr_factor(step: int, warmup: int, total: int = 0, schedule: str = "constant") -> float:
    """The learning-rate factor of ``step`` (0-based) of a ``total``-step run: ``(step + 1) /
    warmup`` during the warm-up (so the first step already moves), then 1 (``"constant"``) or
    half a cosine from 1 to 0 at the last step (``"cosine"``): the engine's schedule."""
    if warmup and step < warmup:
        return min(1.0, (step + 1) / warmup)
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _positive(name: str, value: object, example: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value > 0):
        raise ConfigError(f"{name}={value!r}; a finite number > 0 (e.g. {name}={example}).")
    return float(value)


@dataclass(frozen=True, slots=True)
class FinetuneRecipe:
    """How to fine-tune a converted model: built from the rate it was pretrained at and the
    number of fine-tune steps; every other field has the measured default.

    ``lr`` (a property) is ``factor * pretrain_lr``; ``warmup_steps`` is ``warmup_fraction`` of
    ``steps`` (at least one when the fraction is above 0). ``hold_gates``: the rank gates stay
    frozen (the ranks the conversion chose); False trains them at ``lr`` like any parameter.
    ``max_grad_norm``: the gradient-norm clip (None: none)."""

    pretrain_lr: float
    steps: int
    factor: float = LR_FACTOR
    warmup_fraction: float = WARMUP_FRACTION
    schedule: str = "constant"
    weight_decay: float = 0.0
    hold_gates: bool = True
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        _positive("pretrain_lr", self.pretrain_lr, "1e-3, the rate the model was trained at")
        if not is_int(self.steps, 1):
            raise ConfigError(f"steps={self.steps!r}; the fine-tune's optimizer steps, an int "
                              ">= 1 (e.g. steps=150).")
        _positive("factor", self.factor, str(LR_FACTOR))
        fraction = self.warmup_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not (
                0 <= fraction < 1):
            raise ConfigError(f"warmup_fraction={fraction!r}; a number in [0, 1) (e.g. "
                              f"warmup_fraction={WARMUP_FRACTION}; 0: no warm-up).")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule={self.schedule!r}; one of {', '.join(SCHEDULES)}.")
        wd = self.weight_decay
        if isinstance(wd, bool) or not isinstance(wd, int | float) or not (
                math.isfinite(wd) and wd >= 0):
            raise ConfigError(f"weight_decay={wd!r}; a finite number >= 0 (e.g. 0.0).")
        if not isinstance(self.hold_gates, bool):
            raise ConfigError(f"hold_gates={self.hold_gates!r}; pass True or False.")
        if self.max_grad_norm is not None:
            _positive("max_grad_norm", self.max_grad_norm, "1.0, or None: no clipping")
        if not self.lr < math.inf:
            raise ConfigError(f"factor * pretrain_lr = {self.factor!r} * {self.pretrain_lr!r} "
                              "overflows; pass finite, smaller values.")

    @property
    def lr(self) -> float:
        """The fine-tune's learning rate: ``factor * pretrain_lr`` (to 12 significant digits,
        so 0.3 * 1e-3 reads 0.0003)."""
        return float(f"{self.factor * self.pretrain_lr:.12g}")

    @property
    def warmup_steps(self) -> int:
        """The warm-up's steps: ``warmup_fraction`` of ``steps``, rounded down, at least one
        (none when the fraction is 0)."""
        if self.warmup_fraction == 0:
            return 0
        return max(1, math.floor(round(self.steps * self.warmup_fraction, 9)))

    def optimizer(self, model: nn.Module) -> torch.optim.AdamW:
        """AdamW at :attr:`lr` over ``model``'s trainable parameters in the named groups of
        :func:`~comera.training.trainers.param_groups` (cores, gates, other); with
        ``hold_gates`` the gates are left out (whatever their ``requires_grad``)."""
        groups = []
        config = OptimizerConfig(self.lr, self.lr, self.lr, self.weight_decay)
        for group in param_groups(_checked_model(model), config):
            if group["name"] == "gates" and self.hold_gates:
                continue
            params = [p for p in group["params"] if p.requires_grad]
            if params:
                groups.append({**group, "params": params})
        if not groups:
            held = " besides the held rank gates" if self.hold_gates else ""
            raise ConfigError(f"the {type(model).__name__} has no trainable parameters{held} "
                              "(every requires_grad is False); unfreeze what should train "
                              "(p.requires_grad_(True)).")
        return torch.optim.AdamW(groups, lr=self.lr, weight_decay=self.weight_decay)

    def scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """The recipe's schedule on ``optimizer`` (call its ``step()`` after each optimizer
        step): :func:`lr_factor` of the warm-up, the steps and the schedule."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"scheduler() takes a torch optimizer (recipe.optimizer(model)), "
                              f"got a {type(optimizer).__name__}.")
        rule = functools.partial(lr_factor, warmup=self.warmup_steps, total=self.steps,
                                 schedule=self.schedule)  # a module function: it pickles
        return torch.optim.lr_scheduler.LambdaLR(optimizer, rule)

    def hf_training_args(self) -> dict[str, Any]:
        """The recipe as keyword arguments of ``transformers.TrainingArguments``:
        ``TrainingArguments(out, **recipe.hf_training_args())``. Hold the gates first
        (:func:`hold_gates_`): the Trainer's AdamW takes every parameter that requires grad.
        HuggingFace's warm-up runs one step behind this recipe's (its first step at rate 0);
        for this recipe's schedule exactly, give the Trainer
        ``optimizers=(opt, recipe.scheduler(opt))`` with ``opt = recipe.optimizer(model)``."""
        return {"learning_rate": self.lr, "max_steps": self.steps,
                "warmup_steps": self.warmup_steps,
                "lr_scheduler_type": _HF_SCHEDULER[self.schedule],
                "weight_decay": self.weight_decay,
                "max_grad_norm": 0.0 if self.max_grad_norm is None else self.max_grad_norm}


def _checked_model(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise ConfigError(f"expected a torch nn.Module, got a {type(model).__name__}.")
    return model


def hold_gates_(model: nn.Module, hold: bool = True) -> int:
    """Freeze (``hold``) or release every rank gate of ``model``'s gated layers
    (``requires_grad``), so a trainer that builds its own optimizer (HuggingFace ``Trainer``)
    leaves the ranks the conversion chose; returns how many gate tensors it set."""
    _checked_model(model)
    if not isinstance(hold, bool):
        raise ConfigError(f"hold={hold!r}; pass True (freeze the gates) or False (train them).")
    gates = [g for _, layer in gated_layers(model) for g in layer.gates]
    if not gates:
        raise ConfigError(f"the {type(model).__name__} has no gated layers, so no rank gates "
                          "to hold; convert it first (comera.convert_(model, ...)).")
    for gate in gates:
        gate.requires_grad_(not hold)
    return len(gates)


def finetune(model: nn.Module, batches: Iterable, loss_fn: LossFn | None = None, *,
             recipe: FinetuneRecipe) -> nn.Module:
    """Fine-tune ``model`` in place for ``recipe.steps`` steps and return it.

    ``batches``: dicts the model takes as keyword arguments (``model(**batch)``; the loss is
    ``loss_fn(output, batch)``, else the output's ``.loss`` / ``"loss"``, as a HuggingFace model
    returns given ``labels``), or ``(x, y)`` pairs (the loss is ``loss_fn(model(x), y)``).
    A list or a DataLoader is read again from the start when the steps outlast it; an
    iterator that runs out first is an error naming the steps taken (they stay applied). With
    ``recipe.hold_gates`` the gates are frozen during the run; their ``requires_grad`` and
    every module's train/eval mode are restored after. Each step is
    :class:`~comera.training.trainers.DenseTrainer`'s (finite-loss and gradient checks, the
    clip), then the schedule's."""
    _checked_model(model)
    if not isinstance(recipe, FinetuneRecipe):
        raise ConfigError(f"recipe={recipe!r}; pass comera.FinetuneRecipe(pretrain_lr=..., "
                          "steps=...).")
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(f"loss_fn={loss_fn!r}; a function (output, target) -> scalar "
                          "tensor, or None for a model that returns its own .loss.")
    if isinstance(batches, Tensor | Mapping) or not isinstance(batches, Iterable):
        raise ConfigError(f"batches is a {type(batches).__name__}; pass an iterable of batches "
                          "(a list or a DataLoader of dicts, or of (x, y) pairs).")
    if isinstance(batches, Sized) and len(batches) == 0:
        raise ConfigError("batches is empty; pass at least one batch.")
    layers = list(gated_layers(model))
    flags = [(g, g.requires_grad) for _, layer in layers for g in layer.gates]
    if recipe.hold_gates and layers:
        hold_gates_(model)
    modes = {module: module.training for module in model.modules()}
    try:
        optimizer = recipe.optimizer(model)
        schedule = recipe.scheduler(optimizer)
        trainer = DenseTrainer(model, optimizer, max_grad_norm=recipe.max_grad_norm)
        device = next(p.device for p in model.parameters())
        model.train()
        for step, batch in enumerate(_repeat(batches, recipe.steps)):
            loss = _loss(model, to_device(batch, device), loss_fn, step)
            stats = trainer.step(loss)
            schedule.step()
            if step == 0 or (step + 1) % max(1, recipe.steps // 10) == 0:
                log.info("fine-tune step %d/%d: loss %.4f", step + 1, recipe.steps, stats.loss)
    finally:
        for module, training in modes.items():
            module.training = training
        for gate, flag in flags:
            gate.requires_grad_(flag)
    return model


def _repeat(batches: Iterable, steps: int) -> Iterator:
    """``steps`` batches: ``batches`` read pass after pass; a one-shot iterator (or a pass
    that yields nothing) running out first is a ConfigError."""
    one_shot = iter(batches) is batches
    taken = 0
    while True:
        before = taken
        for batch in batches:
            yield batch
            taken += 1
            if taken == steps:
                return
        if taken == 0:
            raise ConfigError("batches is empty; pass at least one batch.")
        if one_shot or taken == before:
            raise ConfigError(f"batches ran out after {taken} of {steps} steps; pass a list or "
                              "a DataLoader (read again each pass), more batches, or fewer "
                              "steps.")


def _loss(model: nn.Module, batch: Any, loss_fn: LossFn | None, step: int) -> Tensor:
    """One batch's loss (see :func:`finetune`), refused with the batch's step when it has no
    loss, or is not one number."""
    if isinstance(batch, Mapping):
        output = model(**batch)
        if loss_fn is not None:
            loss = loss_fn(output, batch)
        else:
            loss = getattr(output, "loss", None)
            if loss is None and isinstance(output, Mapping):
                loss = output.get("loss")
            if loss is None:
                raise ConfigError(f"step {step}: the model's output (a {type(output).__name__})"
                                  " holds no loss; include labels in the batches (a "
                                  "HuggingFace model) or pass loss_fn(output, batch).")
    elif isinstance(batch, tuple | list) and len(batch) == 2:
        if loss_fn is None:
            raise ConfigError(f"step {step}: an (x, y) batch needs loss_fn(model(x), y), e.g. "
                              "loss_fn=torch.nn.functional.cross_entropy.")
        loss = loss_fn(model(batch[0]), batch[1])
    else:
        shape = (f"a {len(batch)}-tuple" if isinstance(batch, tuple | list)
                 else f"a {type(batch).__name__}")
        raise ConfigError(f"step {step}: the batch is {shape}; a batch is a dict of the model's "
                          "keyword arguments or an (x, y) pair.")
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        got = (f"shape {tuple(loss.shape)}" if isinstance(loss, Tensor)
               else f"a {type(loss).__name__}")
        raise ConfigError(f"step {step}: the loss has {got}; a loss is a scalar tensor (reduce "
                          "it, e.g. with .mean()).")
    if not loss.requires_grad:
        raise ConfigError(f"step {step}: the loss does not require grad, so no parameter can "
                          "learn from it; compute it from the model's output, outside "
                          "torch.no_grad().")
    return loss.reshape(())
