"""Layout-aware lowering: GEMMs read their operands through strides, not copies.

Tucker and block tensor-train (BTT) layers spent their time permuting large intermediates
(issue 32: 252 and 403 MB of copies per step of a 768x3072 layer at B=4096). Their plans now
copy nothing (Tucker) or only the layer's input and output and adjoints no larger than the
output (BTT), and the batched GEMMs over strided batches compute einsum's values, gradients and
second derivatives (float64, gradcheck and gradgradcheck).
"""

from __future__ import annotations

import math

import pytest
import torch

import tncomp
from tests.helpers.tn import bind, operands, reference
from tncomp.compiler.device_model import CPU_DEFAULT, DeviceModel
from tncomp.compiler.layouts import layout_greedy, matrix_view, split
from tncomp.compiler.ops import MatMul, Permute
from tncomp.compiler.orient import orientations
from tncomp.compiler.plan import lower
from tncomp.compiler.problem import Tree, problem_for

IN, OUT = (12, 8, 8), (12, 16, 16)  # the formats benchmark's 768 x 3072 layer


def tucker(in_modes=IN, out_modes=OUT, rank=6, batch="B") -> tncomp.Network:
    """x (b, i1..id) . U_k (i_k, a_k) . G (a1..a2d) . V_k (o_k, a_{d+k}) -> y (b, o1..od)."""
    d = len(in_modes)
    ins = [f"i{k}" for k in range(d)]
    outs = [f"o{k}" for k in range(d)]
    bonds = [f"a{k}" for k in range(2 * d)]
    ops = [("x", ["b", *ins], tncomp.Role.INPUT)]
    ops += [(f"U{k}", [ins[k], bonds[k]], tncomp.Role.PARAMETER) for k in range(d)]
    ops += [(f"V{k}", [outs[k], bonds[d + k]], tncomp.Role.PARAMETER) for k in range(d)]
    ops.append(("G", bonds, tncomp.Role.PARAMETER))
    sizes = {"b": tncomp.Dim(batch) if isinstance(batch, str) else batch,
             **dict(zip(ins, in_modes, strict=True)), **dict(zip(outs, out_modes, strict=True)),
             **dict.fromkeys(bonds, rank)}
    return tncomp.make_network(ops, ("y", ["b", *outs]), sizes)


def btt(in_modes=IN, out_modes=OUT, rank=1, batch="B") -> tncomp.Network:
    """comera's block tensor train: core k (r{k-1}, i_k..i_d, o_1..o_k, r{k})."""
    d = len(in_modes)
    ins = [f"i{k}" for k in range(d)]
    outs = [f"o{k}" for k in range(d)]
    links = [f"r{k}" for k in range(1, d)]
    ops = [("x", ["b", *ins], tncomp.Role.INPUT)]
    for k in range(d):
        idx = ([links[k - 1]] if k else []) + ins[k:] + outs[:k + 1] + \
            ([links[k]] if k < d - 1 else [])
        ops.append((f"core{k}", idx, tncomp.Role.PARAMETER))
    sizes = {"b": tncomp.Dim(batch) if isinstance(batch, str) else batch,
             **dict(zip(ins, in_modes, strict=True)), **dict(zip(outs, out_modes, strict=True)),
             **dict.fromkeys(links, rank)}
    counts = {i: sum(i in ix for _, ix, _ in ops) + (i in outs) for i in sizes}
    return tncomp.make_network(ops, ("y", ["b", *outs]), sizes,
                               [i for i, c in counts.items() if c > 2])


def _plan(net: tncomp.Network, batch: int, model: DeviceModel = CPU_DEFAULT):
    compiled = tncomp.compile(net, model=model, disk_cache=False)
    return compiled.plan_for(bind(net, batch), (True,) * len(net.operands))


def _bytes(net: tncomp.Network, batch: int, which: str) -> int:
    spec = net.operands[0] if which == "input" else net.output
    sizes = bind(net, batch)
    return 4 * math.prod(sizes[i] for i in spec.indices)


# -- when a view exists -------------------------------------------------------------------------

def test_a_batch_group_may_sit_first_or_between_the_matrix_groups():
    sizes = dict.fromkeys("bfkx", 3)
    b, f, k = ("b",), ("f",), ("k",)
    assert split(("b", "f", "k"), {"b"}, {"f"}, {"k"}) == (b, f, k)
    assert split(("f", "b", "k"), {"b"}, {"f"}, {"k"}) == (b, f, k)
    assert split(("f", "k", "b"), {"b"}, {"f"}, {"k"}) is None  # batch innermost: no matrix
    assert split(("f", "b", "x", "k"), {"b"}, {"f", "k"}, {"x"}) is None  # f and k apart
    strided = matrix_view(0, ("f", "b", "k"), sizes, b, f, k)
    assert strided.batch_axis == 1 and not strided.t and strided.shape == (3, 3, 3)
    assert matrix_view(0, ("k", "b", "f"), sizes, b, f, k).t
    assert matrix_view(0, ("f", "k", "b"), sizes, b, f, k) is None


# -- the plans of the formats benchmark's layers ------------------------------------------------

@pytest.mark.parametrize("batch", [4096, 128])
def test_tucker_plans_copy_nothing(batch):
    plan = _plan(tucker(), batch)
    assert plan.copy_bytes == 0
    assert not any(isinstance(op, Permute) for op in (*plan.forward, *plan.backward))


# tncomp calibrate on the 2-core AMD EPYC these plans were measured on (1 thread, loaded)
EPYC = DeviceModel(3.96e10, 3.86e10, 1.56e-6, "2-core EPYC, 1 thread",
                   transpose_slowdown=10.6, gather_slowdown=42.3)


@pytest.mark.parametrize("model", [CPU_DEFAULT, EPYC], ids=["default", "epyc"])
@pytest.mark.parametrize("batch", [4096, 128])
def test_btt_plans_copy_only_the_input_the_output_and_adjoints_no_larger(batch, model):
    """BTT's consecutive steps batch over different blocks ((i2,i3), (i3,o1), (o1,o2)). Bound:
    every copied value is at most the output, and all copies move at most 4x the bytes of input
    and output together (the plan before layout-aware lowering moved 6.4x)."""
    net = btt()
    plan = _plan(net, batch, model)
    x_bytes, y_bytes = _bytes(net, batch, "input"), _bytes(net, batch, "output")
    for op in (*plan.forward, *plan.backward):
        if isinstance(op, Permute):
            assert math.prod(op.shape) * 4 <= y_bytes, op.describe()
    assert plan.copy_bytes <= 4 * (x_bytes + y_bytes)


def test_btt_reads_every_intermediate_in_place_on_a_measured_model():
    """Under this machine's calibration the chain of three strided batched GEMMs wins: the
    forward copies only x (whose blocks are innermost) and the output (written batch first),
    and the backward reads dY in place."""
    plan = _plan(btt(), 4096, EPYC)
    copies = [op.note for op in plan.forward if isinstance(op, Permute)]
    assert copies == ["step 0: lay out left operand", "output layout"]
    strided = [op for op in plan.forward if isinstance(op, MatMul)
               and (op.lhs.batch_axis or op.rhs.batch_axis)]
    assert len(strided) == 3
    first = next(op for op in plan.backward if isinstance(op, MatMul))
    assert plan.dy_slot in first.reads


def test_the_layout_greedy_tree_of_tucker_rotates_every_mode_to_an_end():
    problem = problem_for(tucker(), bind(tucker(), 4096))
    tree = layout_greedy(problem)
    plan = lower(problem, tree, (True,) * 8, model=CPU_DEFAULT)
    assert plan.copy_bytes == 0


def test_orientations_of_a_rotation_need_no_copy_where_step_by_step_choice_did():
    """x.U2, then .U1, .U0, .G, .V0, .V1, .V2: every result must be stored so that the next mode
    is outermost; the dynamic program finds it, all-False orientations copy."""
    net = tucker()
    problem = problem_for(net, bind(net, 4096))
    tree = Tree(8, ((0, 3), (8, 2), (9, 1), (10, 7), (11, 4), (12, 5), (13, 6)))
    swaps = orientations(problem, tree, (True,) * 8, 4, CPU_DEFAULT)
    assert lower(problem, tree, (True,) * 8, swaps=swaps).copy_bytes == 0
    assert lower(problem, tree, (True,) * 8, swaps=[False] * 7).copy_bytes > 0


# -- the values: float64 against einsum, gradcheck, gradgradcheck -----------------------------

SMALL = [("tucker", lambda: tucker((3, 2, 2), (2, 3, 2), 2)),
         ("btt-rank1", lambda: btt((3, 2, 2), (2, 3, 2), 1)),
         ("btt-rank2", lambda: btt((3, 2, 2), (2, 3, 2), 2))]


@pytest.mark.parametrize("memory", ["fast", "min"])
@pytest.mark.parametrize(("name", "build"), SMALL, ids=[s[0] for s in SMALL])
def test_strided_batch_plans_give_einsums_values_and_gradients(name, build, memory):
    net = build()
    compiled = tncomp.compile(net, disk_cache=False, memory=memory)
    for batch in (1, 5, 300):
        ts = operands(net, batch, requires_grad=True)
        y = compiled(*ts)
        expected = reference(net, ts)
        torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
        dy = torch.randn_like(y)
        for got, want in zip(torch.autograd.grad(y, ts, dy),
                             torch.autograd.grad(expected, ts, dy), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("name", "build"), SMALL, ids=[s[0] for s in SMALL])
def test_strided_batch_plans_pass_gradcheck_and_gradgradcheck(name, build):
    net = build()
    compiled = tncomp.compile(net, disk_cache=False)
    ts = operands(net, 3, requires_grad=True)
    assert torch.autograd.gradcheck(compiled, tuple(ts))
    assert torch.autograd.gradgradcheck(compiled, tuple(ts))


def test_the_small_networks_use_strided_batches():
    """(so the value tests above exercise the strided reads)"""
    net = btt((3, 2, 2), (2, 3, 2), 2)
    plan = _plan(net, 300)
    assert any(isinstance(op, MatMul) and (op.lhs.batch_axis or op.rhs.batch_axis)
               for op in (*plan.forward, *plan.backward))
