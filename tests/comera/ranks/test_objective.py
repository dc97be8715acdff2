"""The CoMERA objective (rank_regularizer, soft_size, LateStage) and the trainer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import comera
from comera import LateStage, TTEmbedding, TTLinear, TTMLinear
from comera.ranks.objective import rank_regularizer, soft_size
from comera.ranks.size import dense_size
from comera.training.trainers import param_groups

F64 = torch.float64


def _two_layer_model():
    """TTLinear (6 -> 4, bonds (1, 2, 3, 2, 1)) and TTMLinear (6 -> 4, bonds (1, 2, 1))."""
    tt = TTLinear(6, 4, (2, 3), (2, 2), ranks=[2, 3, 2], tau=0.01, dtype=F64)
    ttm = TTMLinear(6, 4, (2, 3), (2, 2), ranks=[2], tau=0.01, dtype=F64)
    with torch.no_grad():
        tt.gates[0].copy_(torch.tensor([0.5, -2.0]))
        tt.gates[1].copy_(torch.tensor([0.005, 1.5, -0.25]))  # 0.005 <= tau: pruned
        tt.gates[2].copy_(torch.tensor([3.0, 0.01]))  # exactly tau: pruned
        ttm.gates[0].copy_(torch.tensor([1.0, -0.75]))
    return nn.Sequential(tt, ttm)


def test_rank_regularizer_l1_by_hand():
    model = _two_layer_model()
    # surviving |d|: 0.5 + 2 + 1.5 + 0.25 + 3 (TT) + 1 + 0.75 (TTM) = 9.0
    # normalised by the number of gate entries: 2 + 3 + 2 + 2 = 9
    r = rank_regularizer(model)
    assert r.item() == pytest.approx(9.0 / 9.0)
    r.backward()
    tt, ttm = model[0], model[1]
    torch.testing.assert_close(tt.gates[0].grad, torch.tensor([1.0, -1.0], dtype=F64) / 9)
    torch.testing.assert_close(tt.gates[1].grad, torch.tensor([0.0, 1.0, -1.0], dtype=F64) / 9)
    torch.testing.assert_close(tt.gates[2].grad, torch.tensor([1.0, 0.0], dtype=F64) / 9)
    torch.testing.assert_close(ttm.gates[0].grad, torch.tensor([1.0, -1.0], dtype=F64) / 9)
    for core in [*tt.cores, *ttm.cores]:
        assert core.grad is None


def test_rank_regularizer_single_layer_by_hand():
    layer = _two_layer_model()[0]
    # (0.5 + 2 + 1.5 + 0.25 + 3) / 7
    assert rank_regularizer(layer).item() == pytest.approx(7.25 / 7)


def test_rank_regularizer_size_weighted_by_hand():
    layer = _two_layer_model()[0]
    # effective ranks (1, 2, 2, 1, 1); cores (1,2,2) (2,3,3) (3,2,2) (2,2,1): inner 2, 3, 2, 2
    # slice cost of bond k: inner_k * r_{k-1} + inner_{k+1} * r_{k+1}
    #   bond 1: 2*1 + 3*2 = 8;  bond 2: 3*2 + 2*1 = 8;  bond 3: 2*2 + 2*1 = 6
    # R = (8*(0.5+2) + 8*(1.5+0.25) + 6*3) / (8*2 + 8*3 + 6*2) = 52 / 52
    r = rank_regularizer(layer, "size_weighted")
    assert r.item() == pytest.approx(52 / 52)
    with torch.no_grad():
        layer.gates[2][0] = 1.0
    # (8*2.5 + 8*1.75 + 6*1) / 52 = 40 / 52
    assert rank_regularizer(layer, "size_weighted").item() == pytest.approx(40 / 52)


def _all_kinds_model(bias):
    torch.manual_seed(0)
    return nn.ModuleDict({
        "tt": TTLinear(15, 14, (3, 5), (7, 2), ranks=[2, 3, 2], bias=bias, tau=1e-3),
        "tt3": TTLinear(12, 10, (2, 2, 3), (1, 2, 5), ranks=4, bias=bias, tau=1e-3),
        "ttm": TTMLinear(12, 30, (2, 3, 2), (2, 5, 3), ranks=[3, 2], bias=bias, tau=1e-3),
        "emb": TTEmbedding(29, 12, (2, 3, 5), (2, 3, 2), ranks=3, tau=1e-3),
    })


@pytest.mark.parametrize("bias", [False, True])
def test_soft_size_equals_model_size_at_unit_gates(bias):
    model = _all_kinds_model(bias)
    biases = sum(m.bias.numel() for m in model.values() if m.bias is not None)
    soft = soft_size(model)
    assert soft.item() == comera.model_size(model) - biases
    # soft ranks are the l1 norms of the gates: halving one gate halves its bond's terms
    tt = model["tt"]
    with torch.no_grad():
        tt.gates[1].fill_(0.5)
    # TT cores (1,3,2) (2,5,3) (3,7,2) (2,2,1): the middle bond (3) now counts 1.5
    delta = 5 * 2 * (3 - 1.5) + 7 * 2 * (3 - 1.5)
    assert soft_size(model).item() == pytest.approx(soft.item() - delta)


def test_soft_size_counts_gateless_single_core_layers():
    tt = TTLinear(15, 14, (3, 5), (7, 2), ranks=2, bias=False)
    # bonds (1, 2, 2, 2, 1): 1*3*2 + 2*5*2 + 2*7*2 + 2*2*1 = 6 + 20 + 28 + 4 = 58
    single = TTMLinear(6, 5, (6,), (5,), bias=False)  # one core (1, 6, 5, 1): 30, no gates
    model = nn.Sequential(tt, single)
    assert tt.num_parameters() == 58 and single.num_parameters() == 30
    assert comera.model_size(model) == 88
    assert soft_size(model).item() == 58 + 30


LATE_CASES = [
    # (target_size, target_loss, loss, size, expected)
    (100, 0.0, 5.0, 100, "loss"),  # at the target size: loss only
    (100, 0.0, 5.0, 50, "loss"),  # below it
    (100, 0.8, 1.0, 200, "size"),  # size gap 0.5 > loss gap 0.2
    (100, 0.5, 1.0, 110, "loss"),  # size gap 0.09 < loss gap 0.5
    (100, 0.5, 0.3, 400, "size"),  # loss already below its target (gap < 0)
    (100, 0.0, 1.0, 150, "loss"),  # loss gap 1 (target 0) beats size gap 0.33
    (100, 0.0, 1.0, 1e9, "loss"),  # size gap < 1 never beats a zero loss target
]


@pytest.mark.parametrize(("target_size", "target_loss", "loss", "size", "expected"),
                         LATE_CASES)
def test_late_stage_choose(target_size, target_loss, loss, size, expected):
    assert LateStage(target_size, target_loss).choose(loss, size) == expected


def test_late_stage_choose_tie_prefers_loss():
    assert LateStage(100, 1.0).choose(2.0, 200) == "loss"


def test_late_stage_from_ratio_and_objective():
    model = _all_kinds_model(bias=True)
    size = comera.model_size(model)
    late = LateStage.from_ratio(model, 4.0, target_loss=10.0, size_weight=2.0)
    assert late.target_size == pytest.approx(size / 4.0)
    assert LateStage.from_ratio(model, 4.0, dense_reference=8000).target_size == 2000
    loss = torch.tensor(1.0, dtype=torch.float32)
    total, which = late.objective(model, loss)
    assert which == "size"
    expected = 1.0 + 2.0 * soft_size(model).item() / size
    assert total.item() == pytest.approx(expected)
    total, which = late.objective(model, loss, size_reference=1000.0)
    assert total.item() == pytest.approx(1.0 + 2.0 * soft_size(model).item() / 1000)
    small = LateStage(size + 1)
    total, which = small.objective(model, loss)
    assert which == "loss" and total is loss


def _for_compression_model():
    """TT 64 -> 32 (dense 2,080 with bias), TT-matrix 32 -> 16 (dense 528), a plain Linear."""
    return nn.Sequential(TTLinear(64, 32, (4, 4, 4), (2, 4, 4), ranks=4),
                         TTMLinear(32, 16, (4, 8), (4, 4), ranks=3), nn.Linear(16, 2))


def test_for_compression_is_a_ratio_against_dense_of_the_layers_named():
    model = _for_compression_model()
    tt, ttm, plain = model
    size = comera.model_size(model)
    assert (tt.dense_num_parameters(), ttm.dense_num_parameters()) == (2080, 528)
    # every TT layer: the rest (the Linear's 34) + (2080 + 528) / 8
    assert LateStage.for_compression(model, 8).target_size == 34 + 2608 / 8
    # by type: the TT-matrix layer keeps its size, the TT layer goes to 2080 / 10
    late = LateStage.for_compression(model, 10, of=TTLinear, steps=20, floor="one")
    assert late.target_size == size - tt.num_parameters() + 208
    assert (late.steps, late.floor, late.allocation) == (20, "one", "prune")
    # by name ("1" is the TT-matrix layer), and a parent's name takes the layers under it
    assert LateStage.for_compression(model, 4, of="1").target_size == \
        size - ttm.num_parameters() + 132
    assert LateStage.for_compression(model, 8, of=[""]).target_size == 34 + 2608 / 8
    assert LateStage.for_compression(model, 4, of=(TTLinear, TTMLinear)).target_size == \
        34 + 2608 / 4
    assert plain.weight.numel() + plain.bias.numel() == 34


def test_for_compression_rejects_what_it_cannot_mean():
    model = _for_compression_model()
    with pytest.raises(comera.ConfigError, match=r"of=.2. matches no TT layer.*layers: 0, 1"):
        LateStage.for_compression(model, 4, of="2")
    with pytest.raises(comera.ConfigError, match="ratio=1"):
        LateStage.for_compression(model, 1)
    with pytest.raises(comera.ConfigError, match="ratio=True"):
        LateStage.for_compression(model, True)
    with pytest.raises(comera.ConfigError, match=r"of=\[3\]"):
        LateStage.for_compression(model, 4, of=[3])


def _trainable():
    torch.manual_seed(1)
    return nn.Sequential(TTLinear(15, 14, (3, 5), (7, 2), ranks=3), nn.ReLU(),
                         nn.Linear(14, 3))


def test_make_optimizer_groups():
    model = _trainable()
    opt = comera.make_optimizer(model)
    assert isinstance(opt, torch.optim.AdamW)
    groups = opt.param_groups
    assert [g["name"] for g in groups] == ["cores", "gates", "other"]
    assert [g["lr"] for g in groups] == [1e-4, 1e-3, 5e-5]
    assert all(g["weight_decay"] == 0 for g in groups)
    tt = model[0]
    assert [id(p) for p in groups[0]["params"]] == [id(p) for p in tt.cores]
    assert [id(p) for p in groups[1]["params"]] == [id(p) for p in tt.gates]
    assert {id(p) for p in groups[2]["params"]} == {
        id(tt.bias), id(model[2].weight), id(model[2].bias)}
    custom = comera.make_optimizer(model, comera.OptimizerConfig(lr_cores=0.1, weight_decay=0.5))
    assert custom.param_groups[0]["lr"] == 0.1
    assert all(g["weight_decay"] == 0.5 for g in custom.param_groups)


def test_param_groups_leave_out_empty_groups():
    layer = TTLinear(15, 14, (3, 5), (7, 2), ranks=3, bias=False)
    assert [g["name"] for g in param_groups(layer)] == ["cores", "gates"]


@pytest.mark.parametrize("lam", [0.01, 0.0])
def test_trainer_early_step(lam):
    model = _trainable()
    trainer = comera.CoMERATrainer(model, lam=lam)
    x, target = torch.randn(8, 15), torch.randn(8, 3)
    before = [p.detach().clone() for p in model.parameters()]
    loss = (model(x) - target).square().mean()
    reg = rank_regularizer(model).item()
    stats = trainer.step(loss)
    assert isinstance(stats, comera.StepStats)
    assert stats.stage == "early"
    assert stats.loss == pytest.approx(loss.item())
    if lam:
        assert stats.weighted == "loss+rank"
        assert stats.objective == pytest.approx(loss.item() + lam * reg)
    else:
        assert stats.weighted == "loss"
        assert stats.objective == stats.loss
    assert stats.size == comera.model_size(model)
    assert stats.compression == pytest.approx(comera.compression_ratio(model,
                                                                       only=comera.GatedLayer))
    assert stats.model_compression == pytest.approx(dense_size(model) / stats.size)
    assert trainer.steps == 1
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_trainer_late_stage_truncates_and_steps():
    model = _trainable()
    trainer = comera.CoMERATrainer(model)
    with torch.no_grad():
        model[0].gates[1][0] = 0.0
    x = torch.randn(8, 15)
    before = model[0].bonds
    report = trainer.start_late_stage(LateStage.from_ratio(model, 2.0, target_loss=100.0))
    assert report.changed and model[0].bonds != before
    assert trainer.stage == "late"
    stats = trainer.step(model(x).square().mean())
    assert stats.stage == "late" and stats.weighted == "size"
    assert stats.objective > stats.loss
    assert stats.size == comera.model_size(model)
