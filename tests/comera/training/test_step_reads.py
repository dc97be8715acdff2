"""A CoMERA step reads the device back to the host a fixed number of times, however many
gated layers the model has: one read per question for all gates and gradients at once. Asked
a layer at a time, the eager step on an H200 synchronised with the GPU hundreds of times a
step (docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import comera
from comera.errors import NonFiniteGradientError
from tests.helpers.host_reads import PythonReads


def _trainer(layers: int) -> tuple[nn.Module, comera.CoMERATrainer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[comera.TTLinear(64, 64, (4, 4, 4), (4, 4, 4), ranks=6)
                            for _ in range(layers)])
    return model, comera.CoMERATrainer(model, comera.make_optimizer(model), lam=0.1)


def _reads_per_step(layers: int, stage: str, budget: int | None = None) -> int:
    model, trainer = _trainer(layers)
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    if stage == "late":
        trainer.start_late_stage(comera.LateStage(target_size=0.9 * comera.model_size(model),
                                                  steps=budget))
    trainer.step(F.mse_loss(model(x), y))  # the first step may set things up
    with PythonReads() as reads:
        trainer.step(F.mse_loss(model(x), y))
    return reads.calls


@pytest.mark.parametrize(("stage", "budget"), [("early", None), ("late", None), ("late", 10)],
                         ids=["early", "late", "late-budgeted-pruning"])
def test_the_reads_of_a_step_do_not_grow_with_the_number_of_layers(stage, budget):
    """A handful of questions, each read once (how many depends on what the step does, e.g.
    whether the budget prunes this step, never on how many layers it asks about): read a
    layer or a gate at a time, 8 layers took 300 reads in the budgeted late stage."""
    few, many = _reads_per_step(2, stage, budget), _reads_per_step(8, stage, budget)
    assert max(few, many) <= 24, (few, many)


def test_a_non_finite_gradient_is_still_refused_with_its_parameter_named():
    model, trainer = _trainer(3)
    model[1].cores[0].register_hook(lambda g: g + float("inf"))  # a finite loss, an inf grad
    with pytest.raises(NonFiniteGradientError, match=r"1\.cores\.0"):
        trainer.step(model(torch.randn(4, 64)).square().mean())
