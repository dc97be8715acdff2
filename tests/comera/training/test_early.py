"""The size-aware early stage (comera.training.early.EarlyStage): lam switched off at the
target and no step below it, so the early stage stops at the size asked for instead of
collapsing to the rank floor."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import comera
from comera import CoMERATrainer, OptimizerConfig, TTLinear, make_optimizer
from comera.training.early import EarlyStage

F64 = torch.float64
CONFIG = OptimizerConfig(lr_cores=1e-2, lr_gates=5e-2)

pytestmark = pytest.mark.usefixtures("one_thread")


def _model() -> nn.Module:
    """Plain cores: under the balanced parametrization the loss alone closes a gate of this
    toy in 80 steps, and the tests here need a lam that prunes nothing by itself."""
    torch.manual_seed(0)
    return nn.Sequential(TTLinear(16, 32, (4, 4), (4, 8), ranks=6, tau=0.05, dtype=F64,
                                  parametrization="plain"),
                         nn.Tanh(), nn.Linear(32, 4, dtype=F64))


def _train(model, trainer, steps: int = 80):
    g = torch.Generator().manual_seed(1)
    stats = []
    for _ in range(steps):
        x, y = torch.randn(32, 16, generator=g, dtype=F64), torch.randn(32, 4, generator=g,
                                                                         dtype=F64)
        stats.append(trainer.step(F.mse_loss(model(x), y)))
    return stats


def test_the_early_stage_stops_at_the_target_size():
    model = _model()
    early = EarlyStage.for_compression(model, 4)
    outside = comera.model_size(model) - model[0].num_parameters()
    assert early.target_size == pytest.approx(model[0].dense_num_parameters() / 4 + outside)
    trainer = CoMERATrainer(model, make_optimizer(model, CONFIG), lam=5.0, early=early)
    stats = _train(model, trainer)
    sizes = [s.size for s in stats]
    assert sizes[0] > early.target_size  # it starts above and shrinks
    # it lands on S* within one rank slice (here, all gates cross tau in the same step: the
    # hold puts back what it can without going over) and stays there: lam is off
    assert all(s >= 0.9 * early.target_size for s in sizes)
    assert sizes[-1] <= early.target_size and sizes[-20:] == [sizes[-1]] * 20
    assert stats[-1].weighted == "loss"
    # the same lam without the target prunes on to the rank floor
    plain = _model()
    floor = _train(plain, CoMERATrainer(plain, make_optimizer(plain, CONFIG), lam=5.0))
    assert floor[-1].size < 0.9 * early.target_size


def test_the_target_survives_a_checkpoint():
    model = _model()
    early = EarlyStage(1000)
    trainer = CoMERATrainer(model, make_optimizer(model, CONFIG), lam=1.0, early=early)
    other = CoMERATrainer(_model(), lam=1.0)
    other.load_state_dict(trainer.state_dict())
    assert other.controller.early == early


@pytest.mark.parametrize(("bad", "match"), [(0, "target_size=0"), (float("inf"), "inf"),
                                            (True, "True")])
def test_bad_targets_are_refused(bad, match):
    with pytest.raises(comera.ConfigError, match=match):
        EarlyStage(bad)


def test_for_compression_refuses_ratios_and_models_it_cannot_mean():
    with pytest.raises(comera.ConfigError, match="ratio=1"):
        EarlyStage.for_compression(_model(), 1)
    with pytest.raises(comera.ConfigError, match="no TT layers"):
        EarlyStage.for_compression(nn.Linear(3, 3), 4)
    with pytest.raises(comera.ConfigError, match="early=5"):
        CoMERATrainer(_model(), lam=1.0, early=5)


def test_with_a_step_budget_a_lam_too_small_to_prune_grows_until_the_size_follows():
    plain = _model()
    stuck = _train(plain, CoMERATrainer(plain, make_optimizer(plain, CONFIG), lam=1e-4))
    assert stuck[-1].size == stuck[0].size  # lam 1e-4 prunes nothing in 80 steps
    model = _model()
    early = EarlyStage.for_compression(model, 4, steps=80, landing=0.5)
    trainer = CoMERATrainer(model, make_optimizer(model, CONFIG), lam=1e-4, early=early)
    stats = _train(model, trainer, 160)
    assert stats[-1].size <= early.target_size and min(s.size for s in stats) >= \
        0.9 * early.target_size
    assert stats[-1].weighted == "loss"
    assert trainer.controller.early_scale > 10  # lam grew to get there
    state = trainer.state_dict()
    other = CoMERATrainer(_model(), lam=1e-4)
    other.load_state_dict(state)
    assert (other.controller.early, other.controller.early_scale) == (
        early, trainer.controller.early_scale)
