"""GatedLinear in the Tucker, CP and low-rank formats: the layer against its dense
reconstruction, gates that prune, truncation with optimizer state, conversion from nn.Linear."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

import comera
from comera.layers.linear import GatedLinear
from comera.ranks.objective import prune_to_, soft_size
from comera.ranks.truncate import excess_bonds, round_

F64 = torch.float64
FORMATS = ("tucker", "cp", "lowrank")
EXACT = ("tucker", "lowrank")  # formats whose decomposition is exact at full rank
MODES = {"in_modes": (2, 3), "out_modes": (3, 4)}


def _layer(fmt: str, ranks=3, bias: bool = True, seed: int = 0) -> GatedLinear:
    """A 6 -> 12 layer in ``fmt`` (modes (2, 3) -> (3, 4) where the format uses modes), float64,
    gates drawn away from 1 and a nonzero bias, so folding and bias are exercised."""
    torch.manual_seed(seed)
    modes = {} if fmt == "lowrank" else MODES
    layer = GatedLinear(6, 12, format=fmt, ranks=ranks, bias=bias, dtype=F64, **modes)
    with torch.no_grad():
        for g in layer.gates:
            g.uniform_(0.5, 1.5)
        if layer.bias is not None:
            layer.bias.normal_()
    return layer


def _dense_out(layer: GatedLinear, x: torch.Tensor) -> torch.Tensor:
    y = x @ layer.to_dense().T
    return y + layer.bias if layer.bias is not None else y


def _live_weight(layer: GatedLinear) -> torch.Tensor:
    """W (in x out) from the cores cut to each bond's live slices, each gate folded into the
    first core carrying its bond: the pruned layout's dense weight, computed independently."""
    layout = layer.layout
    live = {b: m.nonzero().flatten() for b, m in zip(layout.bonds, layer.gate_masks(),
                                                     strict=True)}
    cores = [c.detach().clone() for c in layer.effective_cores()]
    for bond, gate in zip(layout.bonds, layer.gates, strict=True):
        for n, (c, axis) in enumerate(layout.carriers(bond)):
            cores[c] = cores[c].index_select(axis, live[bond])
            if n == 0:
                shape = [1] * cores[c].dim()
                shape[axis] = -1
                cores[c] = cores[c] * gate.detach()[live[bond]].reshape(shape)
    small = layout.resized({b: int(idx.numel()) for b, idx in live.items()})
    return small.dense(cores)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bias", [True, False])
def test_layer_equals_its_dense_reconstruction(fmt, bias, one_thread):
    layer = _layer(fmt, bias=bias)
    x = torch.randn(5, 6, dtype=F64, requires_grad=True)
    y, ref = layer(x), _dense_out(layer, x)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    params = [x, *layer.parameters()]
    dy = torch.randn_like(y)
    for g, r in zip(torch.autograd.grad(y, params, dy), torch.autograd.grad(ref, params, dy),
                    strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gradcheck(fmt, one_thread):
    layer = _layer(fmt, ranks=2)
    names = [n for n, _ in layer.named_parameters()]
    x = torch.randn(2, 6, dtype=F64, requires_grad=True)
    params = [p.detach().clone().requires_grad_() for p in layer.parameters()]

    def f(x, *ps):
        return functional_call(layer, dict(zip(names, ps, strict=True)), (x,))

    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_zero_gate_entry_prunes_a_slice(fmt, one_thread):
    layer = _layer(fmt)
    with torch.no_grad():
        layer.gates[0][1] = 0.0
    sizes = layer.bond_sizes
    assert layer.bond_ranks == (sizes[0] - 1, *sizes[1:])
    assert layer.num_parameters() == layer.layout.parameters_at(layer.bond_ranks) + 12
    x = torch.randn(4, 6, dtype=F64)
    torch.testing.assert_close(layer(x), x @ _live_weight(layer) + layer.bias)
    torch.testing.assert_close(layer.to_dense().T, _live_weight(layer))


@pytest.mark.parametrize("fmt", FORMATS)
def test_truncate_keeps_the_function_and_the_adam_state(fmt, one_thread):
    layer = _layer(fmt)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-3)
    x = torch.randn(4, 6, dtype=F64)
    layer(x).square().sum().backward()
    opt.step()
    with torch.no_grad():
        for g in layer.gates:
            g[0] = 0.0  # one slice of every bond pruned
    before, sizes = layer(x).detach(), layer.bond_sizes
    comera.truncate_(layer, opt)
    assert layer.bond_sizes == tuple(s - 1 for s in sizes)
    torch.testing.assert_close(layer(x), before, rtol=1e-12, atol=1e-12)
    group = opt.param_groups[0]["params"]
    assert {id(p) for p in group} == {id(p) for p in layer.parameters()}
    for p in layer.parameters():
        for value in opt.state[p].values():
            if value.dim():
                assert value.shape == p.shape
    layer(x).square().sum().backward()
    opt.step()  # the optimizer still runs on the cut parameters


@pytest.mark.parametrize("fmt", EXACT)
def test_from_linear_at_full_rank_reproduces_it(fmt, one_thread):
    torch.manual_seed(1)
    linear = nn.Linear(6, 12, dtype=F64)
    modes = {} if fmt == "lowrank" else MODES
    layer = GatedLinear.from_linear(linear, format=fmt, ranks=12, **modes)
    torch.testing.assert_close(layer.to_dense(), linear.weight, rtol=1e-12, atol=1e-12)
    x = torch.randn(3, 6, dtype=F64)
    torch.testing.assert_close(layer(x), linear(x), rtol=1e-12, atol=1e-12)


def test_cp_from_linear_is_an_als_fit(one_thread):
    """CP has no closed form: from_linear runs ALS, a fit better than its HOSVD start."""
    from comera.formats.cp import cp_als, cp_to_tensor

    torch.manual_seed(2)
    linear = nn.Linear(6, 12, dtype=F64)
    layer = GatedLinear.from_linear(linear, format="cp", ranks=4, **MODES)
    w = linear.weight.detach().T
    start = cp_to_tensor(cp_als(w.reshape(2, 3, 3, 4), 4, 0)).reshape(6, 12)
    assert (layer.to_dense().T - w).norm() < (start - w).norm()
    torch.testing.assert_close(layer.bias, linear.bias)


@pytest.mark.parametrize("fmt", FORMATS)
def test_pickle_round_trip(fmt, one_thread):
    layer = _layer(fmt)
    x = torch.randn(3, 6, dtype=F64)
    again = pickle.loads(pickle.dumps(layer))
    torch.testing.assert_close(again(x), layer(x), rtol=0, atol=0)


def _low_rank_weight(rank: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(6, rank, generator=gen, dtype=F64)
            @ torch.randn(rank, 12, generator=gen, dtype=F64))  # (in, out)


def _unfolding_ranks(w: torch.Tensor, modes: tuple[int, ...]) -> tuple[int, ...]:
    t = w.reshape(modes)
    return tuple(int(torch.linalg.matrix_rank(t.movedim(k, 0).reshape(n, -1)))
                 for k, n in enumerate(modes))


@pytest.mark.parametrize("fmt", EXACT)
def test_round_shrinks_a_redundant_layer_exactly(fmt, one_thread):
    """A rank-1 weight loaded at full rank: bonds carry slices that add nothing; round_ finds
    the weight's own ranks (low-rank: 1; Tucker: the ranks of its unfoldings) and keeps it."""
    layer = _layer(fmt, ranks=12)
    w = _low_rank_weight(1, seed=3)
    layer.load_weight_(w)
    x = torch.randn(4, 6, dtype=F64)
    before, sizes = layer(x).detach(), layer.bond_sizes
    expected = (1,) if fmt == "lowrank" else _unfolding_ranks(w, (2, 3, 3, 4))
    assert sum(expected) < sum(sizes)
    round_(layer, only_excess=False)
    assert layer.bond_sizes == sizes  # stored shapes kept; the cut slices are gated off
    assert layer.bond_ranks == expected
    torch.testing.assert_close(layer(x), before, rtol=1e-10, atol=1e-10)


def test_round_frees_a_tucker_bond_its_pruned_neighbours_cannot_feed(one_thread):
    """Bond a4 (size 4) is carried by the core, whose other bonds are pruned to 1, 1, 2: a4 can
    carry at most 2, so round_ (only excess bonds, the default) cuts it, keeping the weight."""
    layer = _layer("tucker", ranks=12)
    assert layer.bond_sizes == (2, 3, 3, 4)
    with torch.no_grad():
        layer.gates[0][1:] = 0.0
        layer.gates[1][1:] = 0.0
        layer.gates[2][2:] = 0.0
    assert excess_bonds(layer) == [3]
    x = torch.randn(4, 6, dtype=F64)
    before = layer(x).detach()
    round_(layer)
    assert layer.bond_ranks[3] <= 2
    torch.testing.assert_close(layer(x), before, rtol=1e-10, atol=1e-10)


def test_round_leaves_cp_alone(one_thread):
    """CP has no exact rounding: round_ changes nothing."""
    layer = _layer("cp", ranks=5)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    round_(layer, only_excess=False)
    for k, v in layer.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_sizes_and_soft_size_follow_the_layout(fmt, one_thread):
    """model_size counts the cores at the effective ranks; soft_size, at gates of ones, is the
    same count (the layout's one size formula)."""
    layer = _layer(fmt)
    with torch.no_grad():
        for g in layer.gates:
            g.fill_(1.0)
        layer.gates[0][0] = 0.0
    cores = layer.layout.parameters_at(layer.bond_ranks)
    assert comera.model_size(layer) == cores + 12
    torch.testing.assert_close(soft_size(layer).double(),
                               torch.tensor(float(cores), dtype=F64))
    assert comera.compression_ratio(layer) == pytest.approx((72 + 12) / (cores + 12))


@pytest.mark.parametrize("fmt", FORMATS)
def test_saliency_pruning_lands_under_a_size_limit(fmt, one_thread):
    layer = _layer(fmt, ranks=12)
    limit = comera.model_size(layer) * 0.6
    x = torch.randn(4, 6, dtype=F64)
    before = _dense_out(layer, x).detach()
    pruned = prune_to_(layer, limit)
    assert pruned and comera.model_size(layer) <= limit
    comera.truncate_(layer)
    assert layer.layout.parameters_at(layer.bond_sizes) + 12 <= limit
    assert not torch.equal(layer(x), before)  # slices were really cut


@pytest.mark.parametrize(("fmt", "ranks"), [("tucker", 4), ("cp", 12), ("lowrank", 16)])
def test_an_early_and_a_late_stage_land_the_target(fmt, ranks, one_thread):
    """CoMERATrainer's early stage, then a late stage to half the size: the layer lands at or
    below the target, within one rank slice of it, and still computes (not removed)."""
    torch.manual_seed(0)
    modes = {} if fmt == "lowrank" else {"in_modes": (4, 4, 4), "out_modes": (4, 4, 4)}
    teacher = nn.Linear(64, 64, bias=False, dtype=F64).requires_grad_(False)
    layer = GatedLinear(64, 64, format=fmt, ranks=ranks, bias=False, dtype=F64, **modes)
    student = nn.Sequential(layer)
    trainer = comera.CoMERATrainer(student)
    most = max(layer.layout.slice_costs(layer.bond_sizes))

    def train(steps):
        for _ in range(steps):
            x = torch.randn(32, 64, dtype=F64)
            stats = trainer.step(F.mse_loss(student(x), teacher(x)))
        return stats

    train(5)
    late = comera.LateStage.from_ratio(student, 2.0, steps=20)
    trainer.start_late_stage(late)
    stats = train(20)
    assert late.target_size - most < stats.size <= late.target_size
    assert comera.model_size(student) == stats.size and not layer.is_removed()
