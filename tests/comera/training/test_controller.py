"""RankController: the CoMERA stages any loop calls around its optimizer step.

A hand-written loop with the controller must reproduce CoMERATrainer bit for bit (the trainer is
the controller plus backward and the optimizer step), through the early stage, the truncation
with the optimizer state and a late stage with a step budget."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import comera
from comera import CoMERATrainer, OptimizerConfig, RankController, TTLinear, make_optimizer
from comera.ranks.size import dense_size

F64 = torch.float64
CONFIG = OptimizerConfig(lr_cores=1e-2, lr_gates=2.5e-2)
EARLY, LATE = 40, 30

pytestmark = pytest.mark.usefixtures("one_thread")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(TTLinear(16, 32, (4, 4), (4, 8), ranks=6, tau=0.05, dtype=F64),
                         nn.Tanh(), nn.Linear(32, 4, dtype=F64))


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 16, generator=g, dtype=F64),
             torch.randn(32, 4, generator=g, dtype=F64)) for _ in range(n)]


def _late(model):
    return comera.late_stage_for(model, compression=6.0, steps=LATE // 2, target_loss=0.5)


def test_a_hand_loop_with_the_controller_reproduces_comera_trainer_exactly():
    data = _batches(EARLY + LATE)
    a = _model()
    b = copy.deepcopy(a)
    trainer = CoMERATrainer(a, make_optimizer(a, CONFIG), lam=0.5)
    opt = make_optimizer(b, CONFIG)
    controller = RankController(b, opt, lam=0.5)
    stats_a, stats_b = [], []
    for i, (x, y) in enumerate(data):
        if i == EARLY:
            report_a = trainer.start_late_stage(_late(a))
            report_b = controller.start_late_stage(_late(b), optimizer=opt)
            assert str(report_a) == str(report_b) and report_a.changed
        stats_a.append(trainer.step(F.mse_loss(a(x), y)))
        opt.zero_grad(set_to_none=True)
        controller.loss(F.mse_loss(b(x), y)).backward()
        opt.step()
        stats_b.append(controller.after_step(opt))
    assert stats_a == stats_b
    assert {s.stage for s in stats_b} == {"early", "late"}
    assert stats_b[-1].size < stats_b[EARLY - 1].size  # the late stage pruned
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert trainer.state_dict() == controller.state_dict()


def test_penalty_path_matches_the_loss_path():
    """A loop that cannot change its loss backpropagates penalty() after its own backward."""
    data = _batches(12)
    a = _model()
    b = copy.deepcopy(a)
    opt_a, opt_b = make_optimizer(a, CONFIG), make_optimizer(b, CONFIG)
    ca, cb = RankController(a, opt_a, lam=0.5), RankController(b, opt_b, lam=0.5)
    for x, y in data:
        for model, opt, c, hand in ((a, opt_a, ca, False), (b, opt_b, cb, True)):
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), y)
            if hand:
                loss.backward()
                c.penalty(float(loss.detach())).backward()
            else:
                c.loss(loss).backward()
            opt.step()
            c.after_step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)
    assert ca.stats()["ranks"] == cb.stats()["ranks"]
    assert cb.stats()["objective"] > cb.stats()["loss"] > 0


def test_stats_report_the_stage_size_ranks_and_compression():
    model = _model()
    opt = make_optimizer(model, CONFIG)
    controller = RankController(model, opt, lam=0.5)
    x, y = _batches(1)[0]
    controller.loss(F.mse_loss(model(x), y)).backward()
    opt.step()
    step = controller.after_step()
    stats = controller.stats()
    assert stats["stage"] == "early" and stats["steps"] == 1
    assert stats["loss"] == step.loss and stats["objective"] == step.objective > step.loss
    assert stats["size"] == comera.model_size(model)
    assert stats["model_compression"] == pytest.approx(dense_size(model) / stats["size"])
    assert stats["compression"] == pytest.approx(comera.compression_ratio(model, only=TTLinear))
    assert (stats["compression"], stats["model_compression"]) == (step.compression,
                                                                  step.model_compression)
    assert stats["ranks"] == {"0": list(model[0].ranks[1:-1])}


def test_compression_means_the_gated_layers_everywhere_the_whole_model_beside_it():
    """Issue 42, item 2: stats()["compression"] was the whole model's (4.78x) while the late
    stage's target and the HF callback's compression are the gated layers' (8.01x). Now one
    count under one name; the whole model's is ``model_compression``."""
    model = _model()
    opt = make_optimizer(model, CONFIG)
    controller = RankController(model, opt, lam=0.5)
    for x, y in _batches(EARLY):
        controller.loss(F.mse_loss(model(x), y)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        controller.after_step()
    late = comera.late_stage_for(model, compression=6.0, steps=LATE // 2, target_loss=0.5)
    controller.start_late_stage(late)
    for x, y in _batches(LATE):
        controller.loss(F.mse_loss(model(x), y)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step = controller.after_step()
    stats = controller.stats()
    gated = dense_size(model, only=TTLinear) / comera.model_size(model, only=TTLinear)
    assert stats["compression"] == step.compression == pytest.approx(gated)
    assert stats["compression"] >= 0.95 * 6.0  # the late stage's target, in its own terms
    whole = dense_size(model) / comera.model_size(model)
    assert stats["model_compression"] == step.model_compression == pytest.approx(whole)
    assert stats["model_compression"] < stats["compression"]  # the dense head counts there


def test_after_step_without_a_step_is_refused():
    controller = RankController(_model())
    with pytest.raises(comera.ConfigError, match="before the optimizer step"):
        controller.after_step()


@pytest.mark.parametrize("kwargs", [{"lam": -1.0}, {"lam": float("nan")}, {"lam": "0.1"},
                                    {"regularizer": "l2"}, {"min_rank": 1.5},
                                    {"min_rank": -1}, {"optimizer": object()}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(comera.ConfigError):
        RankController(_model(), **kwargs)


def test_clear_moments_has_one_home():
    """The trainer module no longer carries its own copies of the moment clearing."""
    import inspect

    from comera.training import trainers

    source = inspect.getsource(trainers)
    assert "moment[" not in source and "value[off]" not in source


@pytest.mark.parametrize("bad", [1.0, float("inf"), "10", None])
def test_late_stage_for_refuses_a_bad_compression(bad):
    with pytest.raises(comera.ConfigError, match="compression"):
        comera.late_stage_for(_model(), bad, steps=10)


def test_late_stage_for_counts_tt_layers_against_their_dense_size():
    model = _model()
    late = comera.late_stage_for(model, 4.0, steps=10)
    outside = sum(p.numel() for p in model[2].parameters())
    assert late.target_size == pytest.approx(model[0].dense_num_parameters() / 4.0 + outside)


@pytest.mark.parametrize(("field", "value"), [
    ("lr_cores", -1e-3), ("lr_cores", float("nan")), ("lr_gates", float("inf")),
    ("lr_other", "1e-3"), ("weight_decay", -0.1), ("weight_decay", True),
    ("betas", (0.9,)), ("betas", (0.9, 1.0)), ("betas", "0.9,0.99"), ("betas", (-0.1, 0.9)),
])
def test_optimizer_config_refuses_each_bad_field_naming_it(field, value):
    with pytest.raises(comera.ConfigError, match=f"{field}="):
        OptimizerConfig(**{field: value})


def test_optimizer_config_bad_values_cover_every_field():
    import dataclasses

    assert {f.name for f in dataclasses.fields(OptimizerConfig)} == {
        "lr_cores", "lr_gates", "lr_other", "weight_decay", "betas"}


def _below_note(model, prune: bool) -> str:
    """The note of a late stage aimed at half the model's size (as parameters: compression
    below what the model holds), after 2 early steps that prune a rank or nothing."""
    opt = make_optimizer(model, CONFIG)
    controller = RankController(model, opt, lam=0.0)
    for x, y in _batches(2):
        controller.loss(F.mse_loss(model(x), y)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if prune:
            with torch.no_grad():
                model[0].gates[0][:3] = 0.0
        controller.after_step()
    state = controller.state_dict()
    resumed = RankController(model, opt)  # built on the model as it is now: loads the start
    resumed.load_state_dict(state)
    assert resumed.start_size == controller.start_size
    target = 1.2 * comera.model_size(model) if prune else 2.0 * comera.model_size(model)
    resumed.start_late_stage(comera.LateStage(target, steps=5))
    return resumed.late_note


def test_a_late_stage_under_its_target_says_what_put_it_there(caplog):
    """Issue 42, item 3: "below: ... the early stage pruned past it; lower lam or the early
    steps" was said when nothing was pruned and the model's ranks were past the target before
    training. The note now says which happened."""
    with caplog.at_level("WARNING", logger="comera.training.controller"):
        note = _below_note(_model(), prune=False)
    assert note.startswith("below: the stage starts at")
    assert "under it before training" in note and "nothing was pruned" in note
    assert "early stage pruned past" not in note and "lower lam" not in note
    assert "nothing was pruned" in caplog.text  # said when the stage starts
    pruned = _below_note(_model(), prune=True)
    assert "the early stage pruned past it from" in pruned and "lower lam" in pruned
    # a state saved before the start size was kept: both causes named, neither claimed
    controller = RankController(_model())
    state = controller.state_dict()
    del state["start_size"]
    controller.load_state_dict(state)
    controller.start_late_stage(comera.LateStage(2.0 * comera.model_size(controller.model)))
    assert "or built or converted at ranks already past it" in controller.late_note
