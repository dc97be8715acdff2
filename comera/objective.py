"""The CoMERA objective: rank regularisers, the early stage and the late-stage controller.

Early stage: minimise ``L + lam * R`` where R is the l1 norm of the surviving gate entries,
normalised by their count (or weighted by the parameters each rank slice costs).

Late stage, toward a target size S* (and a target loss L*): each step compares the relative
loss gap ``(L - L*) / L`` with the relative size gap ``(S - S*) / S`` and weights whichever
objective is further from its target (a tie goes to the loss): the loss, or a differentiable
size surrogate (the size formula with each rank replaced by the l1 norm of its gate). Once
S <= S*, only the loss is minimised: shrinking stops at the target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from comera.errors import ConfigError
from comera.size import model_size, tt_modules

REGULARIZERS = ("l1", "size_weighted")


def _slice_costs(module) -> list[Tensor]:
    """Per gate, the parameters one rank slice of that bond costs in its two cores."""
    costs = []
    ranks = module.ranks
    for k in range(len(module.gates)):
        left = math.prod(module.cores[k].shape[1:-1]) * ranks[k]
        right = math.prod(module.cores[k + 1].shape[1:-1]) * ranks[k + 2]
        costs.append(torch.tensor(float(left + right)))
    return costs


def rank_regularizer(model: nn.Module, kind: str = "l1") -> Tensor:
    """R(model): normalised l1 of the surviving gate entries (or size-weighted l1)."""
    if kind not in REGULARIZERS:
        raise ConfigError(f"regularizer {kind!r}; choose one of {', '.join(REGULARIZERS)}.")
    total: Tensor | None = None
    norm = 0.0
    for _, module in tt_modules(model):
        gates = module.effective_gates()
        weights = _slice_costs(module) if kind == "size_weighted" else [None] * len(gates)
        for gate, w in zip(gates, weights, strict=True):
            term = gate.abs().sum()
            count = gate.numel()
            if w is not None:
                term, count = term * w.to(gate), count * float(w)
            total = term if total is None else total + term
            norm += count
    if total is None:
        raise ConfigError("the model has no TT layers: convert it with comera.convert_ first.")
    return total / max(norm, 1.0)


def soft_size(model: nn.Module) -> Tensor:
    """The size formula with each bond's rank replaced by the l1 norm of its gate."""
    total: Tensor | float | None = None
    for _, module in tt_modules(model):
        gates = module.effective_gates()
        soft = [1.0] + [g.abs().sum() for g in gates] + [1.0]
        for k, core in enumerate(module.cores):
            term = math.prod(core.shape[1:-1]) * soft[k] * soft[k + 1]
            total = term if total is None else total + term
    if total is None:
        raise ConfigError("the model has no TT layers: convert it with comera.convert_ first.")
    return torch.as_tensor(total) if not isinstance(total, Tensor) else total


@dataclass(frozen=True)
class LateStage:
    """Targets of the late stage: ``target_size`` S* in parameters, ``target_loss`` L*."""

    target_size: float
    target_loss: float = 0.0
    size_weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.target_size > 0:
            raise ConfigError(f"target_size={self.target_size}; it must be > 0 parameters.")
        if self.target_loss < 0:
            raise ConfigError(f"target_loss={self.target_loss}; a loss target is >= 0.")

    @classmethod
    def from_ratio(cls, model: nn.Module, ratio: float, target_loss: float = 0.0,
                   size_weight: float = 1.0, dense_reference: int | None = None) -> LateStage:
        """S* = reference / ratio: ``dense_reference`` (a compression ratio) or, by default,
        the model's effective size now (shrink by ``ratio`` from the start of the stage)."""
        if not ratio > 1:
            raise ConfigError(f"target compression {ratio}; it must be > 1 (a ratio of sizes).")
        reference = dense_reference if dense_reference is not None else model_size(model)
        return cls(reference / ratio, target_loss, size_weight)

    def choose(self, loss: float, size: float) -> str:
        """'loss' or 'size': which objective this step weights (see the module docstring)."""
        if size <= self.target_size:
            return "loss"
        loss_gap = (loss - self.target_loss) / max(abs(loss), 1e-12)
        size_gap = (size - self.target_size) / size
        return "size" if size_gap > loss_gap else "loss"

    def objective(self, model: nn.Module, loss: Tensor, size_reference: float | None = None,
                  decision_loss: float | None = None) -> tuple[Tensor, str]:
        """The scalar to minimise this step and which term it weighted.

        ``decision_loss`` is the loss the choice is made on (default: ``loss``); data-parallel
        workers pass the loss averaged over all workers, so every worker chooses alike.
        """
        size = model_size(model)
        seen = float(loss.detach()) if decision_loss is None else float(decision_loss)
        which = self.choose(seen, float(size))
        if which == "loss":
            return loss, which
        reference = size_reference if size_reference is not None else max(size, 1)
        return loss + self.size_weight * soft_size(model) / reference, which
