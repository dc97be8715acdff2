"""A run's optimizer and learning-rate schedule, each a pure function of the settings and the step.

Optimizers (``EngineConfig.optimizer``):

- ``"groups"`` (the default): AdamW without weight decay in named groups, a CoMERA model's cores,
  gates and other parameters at ``lr``, ``lr_gates`` and ``lr_other``
  (:func:`comera.make_optimizer`); a dense model's parameters in one group at ``lr``;
- ``"adamw"``: ``torch.optim.AdamW(model.parameters(), lr=lr)``, what a user writes (torch's
  defaults otherwise, weight decay 0.01 included; gates at ``lr`` too).

Schedules (``EngineConfig.schedule``), a factor on every group's base rate: linear warm-up over
``warmup`` steps, then ``"constant"`` (the default) or ``"cosine"`` (half a cosine from 1 at the
end of the warm-up to 0 at the run's last step).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import comera
from comera.experiments.task import run_format
from comera.formats.registry import DENSE
from comera.training.finetune import SCHEDULES, lr_factor  # the one schedule rule

OPTIMIZERS = ("groups", "adamw")

__all__ = ["OPTIMIZERS", "SCHEDULES", "base_rates", "lr_factor", "run_optimizer"]


def base_rates(config: Any, tt: bool | None = None) -> dict[str, float]:
    """Each named parameter group's base learning rate (a group without a name: ``"other"``) in a
    run of ``config`` (a CoMERA run unless ``config.format`` is ``"dense"``; ``tt``: the flag of
    before, deprecated, see :func:`~comera.experiments.task.run_format`)."""
    return _rates(config, run_format(config, tt, "base_rates(replace(config, format={}))"))


def _rates(config: Any, format: str) -> dict[str, float]:
    if format == DENSE or config.optimizer == "adamw":
        return {"cores": config.lr, "gates": config.lr, "other": config.lr}
    return {"cores": config.lr, "gates": config.lr_gates,
            "other": config.lr if config.lr_other is None else config.lr_other}


def run_optimizer(model: nn.Module, config: Any, tt: bool | None = None
                  ) -> torch.optim.Optimizer:
    """The optimizer ``config.optimizer`` names for ``model`` (a CoMERA model unless
    ``config.format`` is ``"dense"``; ``tt``: the flag of before, deprecated, see
    :func:`~comera.experiments.task.run_format`)."""
    format = run_format(config, tt, "run_optimizer(model, replace(config, format={}))")
    if config.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=config.lr)
    rates = _rates(config, format)
    if format != DENSE:
        return comera.make_optimizer(model, comera.OptimizerConfig(
            rates["cores"], rates["gates"], rates["other"]))
    return torch.optim.AdamW([{"params": list(model.parameters()), "lr": config.lr,
                               "name": "other"}], weight_decay=0.0)
