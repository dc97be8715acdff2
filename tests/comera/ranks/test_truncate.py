"""Physical rank truncation (comera.truncate_): outputs, bonds and optimizer state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import comera
from comera import TTEmbedding, TTLinear, TTMLinear

F64 = torch.float64


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = TTLinear(12, 10, (2, 2, 3), (1, 2, 5), ranks=4, dtype=F64)
        self.b = TTMLinear(10, 6, (2, 5), (3, 2), ranks=5, dtype=F64)
        self.head = nn.Linear(6, 3, dtype=F64)

    def forward(self, x):
        return self.head(torch.relu(self.b(self.a(x))))


def _prune_(model):
    """Prune a few slices (gates below tau) in every TT layer of ``model``."""
    with torch.no_grad():
        for _, layer in comera.gated_layers(model):
            for k, gate in enumerate(layer.gates):
                gate.uniform_(0.5, 1.5)
                if gate.numel() > 2:
                    gate[1] = -0.8  # a surviving negative gate folds in with its sign
                if gate.numel() > 1:
                    gate[(k % gate.numel())] = 0.2 * layer.tau
                if gate.numel() > 3:
                    gate[-1] = -0.5 * layer.tau


def _adamw_steps(model, opt, x, n=2):
    for _ in range(n):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _keeps(layer):
    return [torch.nonzero(m).flatten() for m in layer.gate_masks()]


def _expected_core_slice(tensor, k, keeps):
    out = tensor
    if k > 0:
        out = out.index_select(0, keeps[k - 1])
    if k < len(keeps):
        out = out.index_select(out.dim() - 1, keeps[k])
    return out


def test_truncate_with_adamw_state():
    torch.manual_seed(0)
    model = Net()
    _prune_(model)
    opt = comera.make_optimizer(model)
    x = torch.randn(7, 12, dtype=F64)
    _adamw_steps(model, opt, x)
    layers = dict(comera.gated_layers(model))
    effective = {n: layer.ranks for n, layer in layers.items()}
    keeps = {n: _keeps(layer) for n, layer in layers.items()}
    assert all(layer.bonds != effective[n] for n, layer in layers.items())
    saved = {
        n: {"cores": [{k: v.clone() for k, v in opt.state[p].items()} for p in layer.cores],
            "gates": [{k: v.clone() for k, v in opt.state[p].items()} for p in layer.gates]}
        for n, layer in layers.items()
    }
    old_params = {id(p) for p in model.parameters()}
    with torch.no_grad():
        y = model(x)

    report = comera.truncate_(model, opt)

    assert report.changed
    assert [name for name, _, _ in report.layers] == ["a", "b"]
    with torch.no_grad():
        torch.testing.assert_close(model(x), y, rtol=1e-10, atol=1e-12)
    for n, layer in layers.items():
        assert layer is dict(comera.gated_layers(model))[n]
        assert layer.bonds == effective[n]
        assert layer.ranks == effective[n]
        assert all(bool((g == 1).all()) for g in layer.gates)  # folded into the cores
        for k, core in enumerate(layer.cores):
            state = opt.state[core]
            for key in ("exp_avg", "exp_avg_sq"):
                expected = _expected_core_slice(saved[n]["cores"][k][key], k, keeps[n])
                assert torch.equal(state[key], expected), (n, k, key)
            assert torch.equal(state["step"], saved[n]["cores"][k]["step"])
        for k, gate in enumerate(layer.gates):
            for key in ("exp_avg", "exp_avg_sq"):
                expected = saved[n]["gates"][k][key].index_select(0, keeps[n][k])
                assert torch.equal(opt.state[gate][key], expected), (n, k, key)

    # the optimizer holds exactly the model's parameters, none of the replaced ones
    in_groups = [p for g in opt.param_groups for p in g["params"]]
    assert {id(p) for p in in_groups} == {id(p) for p in model.parameters()}
    assert len(in_groups) == len(list(model.parameters()))
    assert {id(p) for p in opt.state} <= {id(p) for p in model.parameters()}
    replaced = old_params - {id(p) for p in model.parameters()}
    assert replaced  # cores and gates were replaced by new parameters
    assert [g["name"] for g in opt.param_groups] == ["cores", "gates", "other"]
    assert {id(p) for p in opt.param_groups[0]["params"]} == {
        id(p) for layer in layers.values() for p in layer.cores}

    # a further step runs and updates the new parameters
    before = [p.detach().clone() for p in model.parameters()]
    _adamw_steps(model, opt, x, n=1)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert all(int(opt.state[p]["step"]) == 3 for p in model.parameters())


def test_truncate_without_optimizer_and_with_grads():
    torch.manual_seed(1)
    model = Net()
    _prune_(model)
    x = torch.randn(5, 12, dtype=F64)
    model(x).sum().backward()
    keeps = _keeps(model.a)
    old_grads = [p.grad.clone() for p in model.a.cores]
    with torch.no_grad():
        y = model(x)
    comera.truncate_(model)
    with torch.no_grad():
        torch.testing.assert_close(model(x), y, rtol=1e-10, atol=1e-12)
    for k, core in enumerate(model.a.cores):
        assert torch.equal(core.grad, _expected_core_slice(old_grads[k], k, keeps))


@pytest.mark.parametrize("merge_pairs", [True, False])
def test_truncate_embedding_keeps_outputs(merge_pairs):
    torch.manual_seed(2)
    emb = TTEmbedding(29, 12, (2, 3, 5), (2, 3, 2), ranks=5, padding_idx=3,
                      merge_pairs=merge_pairs, dtype=F64)
    model = nn.Sequential(emb)
    _prune_(model)
    opt = comera.make_optimizer(model)
    ids = torch.tensor([[0, 3, 28], [7, 7, 12]])
    _adamw_steps(model, opt, ids)
    effective = emb.ranks
    with torch.no_grad():
        y = model(ids)
    comera.truncate_(model, opt)
    assert emb.bonds == effective
    with torch.no_grad():
        torch.testing.assert_close(model(ids), y, rtol=1e-10, atol=1e-12)
    _adamw_steps(model, opt, ids, n=1)


@pytest.mark.parametrize("cls", [TTLinear, TTMLinear])
def test_truncate_all_zero_gate_keeps_bias(cls):
    torch.manual_seed(3)
    layer = cls(12, 10, (2, 2, 3), (1, 2, 5), ranks=4, dtype=F64)
    with torch.no_grad():
        layer.bias.normal_()
        layer.gates[1].fill_(0.001)
    model = nn.Sequential(layer)
    opt = comera.make_optimizer(model)
    x = torch.randn(3, 12, dtype=F64)
    _adamw_steps(model, opt, x)
    assert layer.is_removed()
    comera.truncate_(model, opt)
    assert layer.is_removed()
    assert layer.num_parameters() == 10
    with torch.no_grad():
        torch.testing.assert_close(model(x), layer.bias.expand(3, 10))
    _adamw_steps(model, opt, x, n=1)


@pytest.mark.parametrize("cls", [TTLinear, TTMLinear])
def test_truncate_twice_is_idempotent(cls):
    torch.manual_seed(4)
    layer = cls(12, 10, (2, 2, 3), (1, 2, 5), ranks=4, dtype=F64)
    model = nn.Sequential(layer)
    _prune_(model)
    opt = comera.make_optimizer(model)
    x = torch.randn(3, 12, dtype=F64)
    _adamw_steps(model, opt, x)
    comera.truncate_(model, opt)
    bonds = layer.bonds
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    with torch.no_grad():
        y = model(x)
    report = comera.truncate_(model, opt)
    assert not report.changed
    assert layer.bonds == bonds
    for a, p in zip(params, model.parameters(), strict=True):
        assert torch.equal(a, p)
    for s, p in zip(state, model.parameters(), strict=True):
        assert all(torch.equal(v, opt.state[p][k]) for k, v in s.items())
    with torch.no_grad():
        assert torch.equal(model(x), y)


def test_truncate_removed_layer_twice_is_idempotent():
    layer = TTLinear(12, 10, (3, 4), (2, 5), ranks=3, dtype=F64)
    with torch.no_grad():
        layer.gates[1].zero_()
    comera.truncate_(layer)
    first = layer.bonds
    report = comera.truncate_(layer)
    assert layer.bonds == first
    assert not report.changed


def test_truncate_without_folding_keeps_gates():
    torch.manual_seed(5)
    model = Net()
    _prune_(model)
    x = torch.randn(5, 12, dtype=F64)
    effective = model.a.ranks
    surviving = [g.detach()[m].clone() for g, m in zip(model.a.gates, model.a.gate_masks(),
                                                        strict=True)]
    with torch.no_grad():
        y = model(x)
    comera.truncate_(model, fold_gates=False)
    assert model.a.bonds == effective
    for g, kept in zip(model.a.gates, surviving, strict=True):
        assert torch.equal(g.detach(), kept)
    with torch.no_grad():
        torch.testing.assert_close(model(x), y, rtol=1e-10, atol=1e-12)


def test_report_str():
    model = Net()
    _prune_(model)
    report = comera.truncate_(model)
    text = str(report)
    assert text.splitlines()[0] == f"a: (1, 2, 4, 4, 4, 4, 1) -> {model.a.bonds}"
    assert text.splitlines()[1] == "b: (1, 5, 1) -> (1, 3, 1)"
    assert text.count("\n") == 1
    assert str(comera.truncate_(nn.Sequential(nn.Linear(2, 2)))) == "no TT layers"


def _starved(cls):
    """A layer whose first bond is cut to one slice: the next bond's 16 exceed what it allows."""
    torch.manual_seed(0)
    layer = cls(64, 64, in_modes=(2, 2, 16), out_modes=(2, 2, 16), ranks=16).double()
    with torch.no_grad():
        for gate in layer.gates:
            gate.uniform_(0.5, 1.5)
        layer.gates[0][1:] = 0.0
    return layer


@pytest.mark.parametrize("cls", [TTLinear, TTMLinear])
def test_round_layer_keeps_the_weight_and_frees_excess_slices(cls):
    from comera.ranks.truncate import excess_bonds, round_layer_

    layer = _starved(cls)
    x = torch.randn(3, 64, dtype=torch.float64)
    before = layer(x).detach()
    size = layer.num_parameters()
    assert excess_bonds(layer)
    assert round_layer_(layer)
    layer.build_compiled()
    assert excess_bonds(layer) == []
    assert layer.num_parameters() < size
    assert [c.shape for c in layer.cores] == [c.shape for c in _starved(cls).cores]  # in place
    torch.testing.assert_close(layer(x).detach(), before, rtol=1e-10, atol=1e-10)


def test_round_layer_resets_moments_and_skips_removed_layers():
    from comera.ranks.truncate import round_layer_

    layer = _starved(TTLinear)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-3)
    layer(torch.randn(2, 64, dtype=torch.float64)).sum().backward()
    opt.step()
    round_layer_(layer, opt)
    for param in [*layer.cores, *layer.gates]:
        state = opt.state[param]
        assert not state["exp_avg"].any()
        assert torch.allclose(state["exp_avg_sq"], state["exp_avg_sq"].mean().expand_as(param))
    with torch.no_grad():
        layer.gates[1].zero_()
    assert layer.is_removed() and not round_layer_(layer)


def test_round_model_rounds_only_the_layers_with_excess_bonds():
    from comera.ranks.truncate import round_

    starved, full = _starved(TTLinear), _starved(TTLinear)
    with torch.no_grad():
        full.gates[0].fill_(1.0)
    model = nn.Sequential(starved, full)
    x = torch.randn(3, 64, dtype=torch.float64)
    before, full_cores = model(x).detach(), [c.detach().clone() for c in full.cores]
    report = round_(model)
    (_, b0, a0), (_, b1, a1) = report.layers
    assert a0 < b0 and sum(a0) < sum(b0) and a1 == b1
    assert all(torch.equal(c, d) for c, d in zip(full.cores, full_cores, strict=True))
    torch.testing.assert_close(model(x).detach(), before, rtol=1e-10, atol=1e-10)
