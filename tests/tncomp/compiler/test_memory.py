"""Memory modes: results and gradients unchanged, saved bytes as planned and as autograd keeps.

``memory="fast"`` saves every forward intermediate the backward reads; ``"min"`` saves none and
the backward replays the forward steps it needs; ``"balanced"`` and a byte budget sit between.
The plan's ``saved_bytes`` must be exactly what autograd holds beyond the operands (counted with
saved-tensor hooks), and the modes must agree with torch.einsum in float64.
"""

from __future__ import annotations

import pytest
import torch

import tncomp
from tests.helpers.saved import saved_by_autograd
from tests.helpers.tn import F64, bind, compile_net, operands, reference
from tncomp.compiler.device_model import DeviceModel
from tncomp.compiler.memory import (
    MEMORY_CHOICES,
    apply_memory,
    check_memory,
    saved_formula,
    with_recompute,
)
from tncomp.compiler.plan import lower
from tncomp.compiler.problem import problem_for
from tncomp.compiler.search import choose_plan
from tncomp.errors import OptionError

TOL = {"rtol": 1e-9, "atol": 1e-10}
MODES = [*MEMORY_CHOICES, 4096]
NETS = {
    # intermediates larger than the input: x (B, 4, 6) meets rank-8 cores
    "tt_d2": lambda: tncomp.tt_linear((4, 6), (6, 4), (1, 8, 8, 8, 1)),
    "tt_d3": lambda: tncomp.tt_linear((2, 3, 4), (4, 3, 2), 5),
    "ttm_d2": lambda: tncomp.ttm_linear((4, 6), (6, 4), 6),
    "embedding": lambda: tncomp.ttm_embedding((2, 3), (3, 2), 3),
    "eq_summed": lambda: tncomp.from_eq("bijk,kl->bil", ("B", 2, 3, 2), (2, 3)),
}


@pytest.mark.parametrize("name", sorted(NETS))
@pytest.mark.parametrize("memory", MODES, ids=str)
def test_modes_match_einsum_and_autograd_keeps_the_planned_bytes(name, memory):
    net = NETS[name]()
    f = compile_net(net, memory=memory)
    ts = operands(net, 5, seed=3, requires_grad=True)
    refs = [t.detach().clone().requires_grad_() for t in ts]
    y, kept = saved_by_autograd(f, *ts)
    operand_bytes = sum(t.numel() * t.element_size() for t in ts)
    plan = f.plan_of(*ts)
    assert kept == operand_bytes + plan.saved_bytes
    ry = reference(net, refs)
    torch.testing.assert_close(y, ry, **TOL)
    dy = torch.randn_like(ry)
    torch.testing.assert_close(torch.autograd.grad(y, ts, dy), torch.autograd.grad(ry, refs, dy),
                               **TOL)


@pytest.mark.parametrize("name", ["tt_small", "eq_summed"])
def test_min_passes_gradcheck(name):
    net = (tncomp.tt_linear((2, 3), (3, 2), (1, 3, 4, 3, 1)) if name == "tt_small"
           else NETS[name]())
    f = compile_net(net, memory="min")
    ts = operands(net, 2, seed=5, requires_grad=True)
    assert f.plan_of(*ts).recomputed
    assert torch.autograd.gradcheck(f, tuple(ts), eps=1e-6, atol=1e-7, rtol=1e-6)


def test_min_saves_less_than_fast_on_a_tt_layer():
    net = tncomp.tt_linear((4, 4, 4), (4, 4, 4), 16)
    ts = operands(net, 16, requires_grad=True)
    fast, low = (compile_net(net, memory=m, optimize="search").plan_of(*ts)
                 for m in ("fast", "min"))
    x_bytes = ts[0].numel() * 8
    assert fast.saved_bytes > x_bytes  # the premise: intermediates larger than the input
    assert low.saved_bytes == 0 and low.saved == ()
    assert set(low.recomputed) == set(fast.saved)
    assert low.recompute_flops > 0 and low.recompute_time(DeviceModel()) > 0
    assert fast.recompute_flops == 0 and fast.recomputed == ()
    assert low.forward == fast.forward or low.tree != fast.tree  # same steps, fewer saves


def test_balanced_sits_between_and_within_its_time_limit():
    net = tncomp.tt_linear((8, 8, 12), (12, 16, 16), 30)
    problem = problem_for(net, bind(net, 4096))
    model = DeviceModel()
    grads = (True,) * len(net.operands)
    base = choose_plan(problem, grads, 4, model).plan
    plans = {m: apply_memory(base, m, model) for m in MEMORY_CHOICES}
    assert plans["min"].saved_bytes <= plans["balanced"].saved_bytes <= plans["fast"].saved_bytes
    assert plans["balanced"].saved_bytes < plans["fast"].saved_bytes  # it does drop something
    assert plans["balanced"].modelled_time(model) <= 1.1 * base.modelled_time(model)


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.7, 1.0])
def test_a_byte_budget_is_respected_and_min_is_its_floor(fraction):
    net = NETS["tt_d3"]()
    problem = problem_for(net, bind(net, 256))
    model = DeviceModel()
    plan = lower(problem, choose_plan(problem, (True,) * 7, 8, model).plan.tree, (True,) * 7, 8)
    budget = int(fraction * plan.saved_bytes)
    fitted = apply_memory(plan, budget, model)
    assert fitted.saved_bytes <= budget
    if fraction == 1.0:
        assert fitted == plan  # nothing to drop
    floor = apply_memory(plan, "min", model)
    assert apply_memory(plan, 0, model).saved_bytes == floor.saved_bytes == 0


def test_saved_formula_matches_the_bound_plan():
    net = NETS["tt_d2"]()
    symbolic = problem_for(net)
    (dim,) = net.dims
    for memory in ("fast", "min"):
        f = compile_net(net, memory=memory)
        ts = operands(net, 33, requires_grad=True)
        plan = f.plan_of(*ts)
        formula = saved_formula(plan, symbolic)
        value = formula.subs(dim.symbol, 33) if hasattr(formula, "subs") else formula
        assert int(value) == plan.saved_bytes


def test_recompute_replays_just_before_first_use_and_frees_after_last():
    net = NETS["tt_d3"]()
    problem = problem_for(net, bind(net, 16))
    plan = lower(problem, choose_plan(problem, (True,) * 7, 8, DeviceModel()).plan.tree,
                 (True,) * 7, 8)
    low = with_recompute(plan, plan.saved)
    replayed = [k for k, op in enumerate(low.backward) if op.dst < low.dy_slot]
    assert sorted(low.backward[k].dst for k in replayed) == sorted(plan.saved) == list(
        low.recomputed)
    for k in replayed:  # each replayed slot is read after it is made, and freed in the backward
        slot = low.backward[k].dst
        assert any(slot in op.reads for op in low.backward[k + 1:])
        assert any(slot in frees for frees in low.backward_frees[k:])
    # the first replay waits for the first backward step that needs a dropped slot
    first_need = next(k for k, op in enumerate(plan.backward)
                      if set(op.reads) & set(plan.saved))
    assert replayed[0] >= first_need
    assert all(s not in low.saved for s in low.recomputed)


def test_modes_have_their_own_cache_keys(tmp_path):
    net = NETS["tt_d2"]()
    plans = {}
    for memory in ("fast", "min", "balanced", 1000):
        f = tncomp.compile(net, memory=memory, disk_cache=tmp_path)
        ts = operands(net, 9, requires_grad=True)
        plans[str(memory)] = f.plan_of(*ts)
        assert f.options.memory == memory
    assert plans["fast"].saved != plans["min"].saved
    keys = set()
    for memory in ("fast", "min", "balanced", 1000):
        planner = tncomp.compile(net, memory=memory, disk_cache=False)._planner
        sizes = bind(net, 9)
        keys.add(planner.tree_key(sizes, (True,) * 5, 8, DeviceModel()))
        keys.add(planner.regimes_key((True,) * 5, 8, DeviceModel()))
    assert len(keys) == 8
    # "fast" keeps the disk keys of before memory modes (no memory part)
    fast = tncomp.compile(net, disk_cache=False)._planner
    assert "memory" not in repr(fast.regimes_key((True,) * 5, 8, DeviceModel()))


@pytest.mark.parametrize("bad", ["low", "", None, -1, 1.5, True])
def test_a_bad_memory_mode_is_an_option_error_naming_it(bad):
    with pytest.raises(OptionError, match="memory=") as info:
        tncomp.compile(NETS["tt_d2"](), memory=bad)
    assert repr(bad) in str(info.value) and "'balanced'" in str(info.value)
    with pytest.raises(OptionError, match="memory="):
        check_memory(bad)


def test_contract_takes_memory():
    a, b = torch.randn(5, 6, dtype=F64), torch.randn(6, 7, dtype=F64)
    torch.testing.assert_close(tncomp.contract("ij,jk->ik", a, b, memory="min"), a @ b)


def test_min_under_create_graph_and_complex():
    net = NETS["tt_d2"]()
    f = compile_net(net, memory="min")
    ts = operands(net, 3, seed=2, requires_grad=True)
    refs = [t.detach().clone().requires_grad_() for t in ts]
    g = torch.autograd.grad(f(*ts).square().sum(), ts, create_graph=True)[1]
    rg = torch.autograd.grad(reference(net, refs).square().sum(), refs, create_graph=True)[1]
    torch.testing.assert_close(torch.autograd.grad(g.sum(), ts[0])[0],
                               torch.autograd.grad(rg.sum(), refs[0])[0], **TOL)
    cs = [torch.complex(t.detach(), torch.randn_like(t)).requires_grad_() for t in ts]
    crefs = [t.detach().clone().requires_grad_() for t in cs]
    y, ry = f(*cs), reference(net, crefs)
    torch.testing.assert_close(y, ry, **TOL)
    dy = torch.randn_like(ry)
    torch.testing.assert_close(torch.autograd.grad(y, cs, dy), torch.autograd.grad(ry, crefs, dy),
                               **TOL)
