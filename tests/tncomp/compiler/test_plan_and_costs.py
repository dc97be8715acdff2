"""Symbolic costs, batch regimes, lowered plans and the inspect report of the paper's FFN layer.

The layer is CoMERA's 768 -> 3072 TT layer, tt_linear([12, 8, 8], [12, 16, 16], 30). With the
int rank clipped at each bond, the cores are

    core1 (1, 12, 12)  core2 (12, 8, 30)  core3 (30, 8, 30)      input side:  i1 i2 i3
    core4 (30, 12, 30) core5 (30, 16, 16) core6 (16, 16, 1)      output side: o1 o2 o3

Every expected number below is worked out by hand from these shapes (FLOPs = 2 per
multiply-add), not taken from tncomp.
"""

from __future__ import annotations

import itertools

import pytest
import sympy
import torch

import tncomp
from tests.helpers.tn import bind, compile_net
from tncomp.compiler.cost import tree_costs
from tncomp.compiler.ops import MatMul, Permute
from tncomp.compiler.problem import problem_for

B = sympy.Symbol("B", positive=True, integer=True)
N_OPERANDS = 7
ALL_GRAD = (True,) * N_OPERANDS

# Merging the input-side cores, FLOP-optimal order ((core1.core2).core3):
#   core1.core2 -> (i1, i2, r2) = (12, 8, 30), summing r1 = 12:  2 * 12*8*30 * 12
#   (core1.core2).core3 -> (i1, i2, i3, r3), summing r2 = 30:    2 * 12*8*8*30 * 30
MERGE_IN = 2 * 12 * 8 * 30 * 12 + 2 * 12 * 8 * 8 * 30 * 30
# Output side, order (core4.(core5.core6)):
#   core5.core6 -> (r4, o2, o3) = (30, 16, 16), summing r5 = 16: 2 * 30*16*16 * 16
#   core4.(core5.core6) -> (r3, o1, o2, o3), summing r4 = 30:    2 * 30*12*16*16 * 30
MERGE_OUT = 2 * 30 * 16 * 16 * 16 + 2 * 30 * 12 * 16 * 16 * 30
# Then x (B, 768) @ W_in (768, 30) and (B, 30) @ W_out (30, 3072).
PER_SAMPLE = 2 * (768 * 30 + 30 * 3072)
EXPECTED_FORWARD = PER_SAMPLE * B + MERGE_IN + MERGE_OUT


@pytest.fixture(scope="module")
def net():
    return tncomp.tt_linear([12, 8, 8], [12, 16, 16], 30)


@pytest.fixture(scope="module")
def compiled(net):
    return compile_net(net)


@pytest.fixture(scope="module")
def table(compiled):
    return compiled.regimes()  # all gradients, float32


def _leaf_sets(tree):
    covers = tree.leaves_under()
    return [covers[tree.n_leaves + k] for k in range(len(tree.steps))]


def test_core_shapes(net):
    shapes = [net.shape(t) for t in net.operands[1:]]
    assert shapes == [(1, 12, 12), (12, 8, 30), (30, 8, 30), (30, 12, 30), (30, 16, 16),
                      (16, 16, 1)]
    assert MERGE_IN == 1_451_520 and MERGE_OUT == 5_775_360


def test_large_batch_tree_merges_the_factors(table):
    tree = table.tree_for(4096)
    sets = _leaf_sets(tree)
    x, w_in, w_out = 0, frozenset({1, 2, 3}), frozenset({4, 5, 6})
    assert frozenset({1, 2}) in sets and w_in in sets  # ((core1.core2).core3)
    assert frozenset({5, 6}) in sets and w_out in sets  # (core4.(core5.core6))
    assert w_in | {x} in sets  # x . W_in
    # the last step joins (x . W_in) with W_out
    a, b = tree.steps[-1]
    covers = tree.leaves_under()
    assert {covers[a], covers[b]} == {w_in | {x}, w_out}


def _symbolic_costs(net, table, needs=ALL_GRAD):
    return tree_costs(problem_for(net), table.tree_for(4096), needs, itemsize=4)


def test_symbolic_costs_are_linear_in_b(net, table):
    costs = _symbolic_costs(net, table)
    fwd = sympy.Poly(sympy.expand(costs.forward_flops), B)
    assert fwd.degree() == 1
    assert fwd.all_coeffs()[0] == PER_SAMPLE  # 2*B*(768*30 + 30*3072)
    # the reversed tree: both adjoints of every step are needed when every operand needs grad
    assert sympy.simplify(costs.backward_flops - 2 * EXPECTED_FORWARD) == 0
    for formula in (costs.forward_bytes, costs.backward_bytes, costs.saved_bytes):
        assert sympy.Poly(sympy.expand(formula), B).degree() == 1
    at = costs.subs({"B": 4096})
    assert isinstance(at.forward_flops, int) and isinstance(at.peak_bytes, int)
    assert at == costs.subs({B: 4096})
    assert at.backward_flops == 2 * (PER_SAMPLE * 4096 + MERGE_IN + MERGE_OUT)


def test_symbolic_forward_flops_exact_value(net, table):
    costs = _symbolic_costs(net, table)
    assert sympy.simplify(costs.forward_flops - EXPECTED_FORWARD) == 0
    assert sympy.simplify(costs.total_flops - 3 * EXPECTED_FORWARD) == 0


def test_costs_without_input_gradient(net, table):
    """With x frozen, x . W_in needs no adjoint for x: one GEMM of 2*B*768*30 fewer."""
    tree = table.tree_for(4096)
    needs = (False,) + (True,) * 6
    costs = tree_costs(problem_for(net), tree, needs)
    expected = 2 * EXPECTED_FORWARD - 2 * 768 * 30 * B
    assert sympy.simplify(costs.backward_flops - expected) == 0


def test_plan_at_4096_matches_the_formulas_and_copies_nothing(net, compiled, table):
    plan = compiled.plan_for(bind(net, 4096), ALL_GRAD)
    assert plan.tree == table.tree_for(4096)
    fwd = PER_SAMPLE * 4096 + MERGE_IN + MERGE_OUT
    assert plan.forward_flops == fwd
    assert plan.backward_flops == 2 * fwd
    assert plan.copy_bytes == 0
    assert not any(isinstance(op, Permute) for op in (*plan.forward, *plan.backward))
    gemms = [op for op in plan.forward if isinstance(op, MatMul)]
    assert len(gemms) == N_OPERANDS - 1
    assert all(g is None or isinstance(g, int) for g in plan.grad_slots)
    assert plan.output_shape == (4096, 12, 16, 16)


@pytest.mark.parametrize("batch", [1, 2, 16, 300, 4096])
def test_plan_backward_flops_equal_tree_costs_at_bound_sizes(net, compiled, batch):
    plan = compiled.plan_for(bind(net, batch), ALL_GRAD)
    costs = tree_costs(problem_for(net, bind(net, batch)), plan.tree, ALL_GRAD)
    assert plan.backward_flops == costs.backward_flops
    gemm_flops = sum(op.flops for op in plan.forward if isinstance(op, MatMul))
    assert plan.forward_flops == gemm_flops


def test_plan_forward_flops_equal_tree_costs_at_bound_sizes(net, compiled):
    for batch in (1, 2, 16, 300, 4096):
        plan = compiled.plan_for(bind(net, batch), ALL_GRAD)
        costs = tree_costs(problem_for(net, bind(net, batch)), plan.tree,
                                  ALL_GRAD)
        assert plan.forward_flops == costs.forward_flops, batch


def test_regimes(net, table):
    assert table.dim.name == "B"
    regimes = table.regimes
    assert len(regimes) >= 2
    assert regimes[0].lo == 1
    for a, b in itertools.pairwise(regimes):
        assert b.lo == a.hi + 1  # contiguous, no gaps or overlaps
        assert a.tree != b.tree  # neighbours differ (merged otherwise)
    bps = table.breakpoints
    assert list(bps) == sorted(set(bps)) and all(bp > 1 for bp in bps)
    assert bps == tuple(r.lo for r in regimes[1:])
    assert table.tree_for(1) != table.tree_for(4096)
    for r in regimes:
        assert table.tree_for(r.lo) == r.tree and table.tree_for(r.hi) == r.tree
    for bp, prev in zip(bps, regimes, strict=False):
        assert table.tree_for(bp - 1) == prev.tree
    # small batches contract x into the train core by core: x meets core1 first
    first = _leaf_sets(table.tree_for(1))[0]
    assert 0 in first


def test_regime_choice_beats_the_other_regimes_trees(net, table):
    """At each regime's midpoint its tree is modelled no slower than every other regime's."""
    from tncomp.compiler.device_model import CPU_DEFAULT
    from tncomp.compiler.plan import lower

    for r in table.regimes:
        b = r.lo if r.hi - r.lo > 1 << 16 else (r.lo + r.hi) // 2
        problem = problem_for(net, bind(net, b))

        def time(tree, problem=problem):
            return lower(problem, tree, ALL_GRAD, 4, model=CPU_DEFAULT).modelled_time(CPU_DEFAULT)

        mine = time(r.tree)
        for other in table.regimes:
            assert mine <= time(other.tree) * (1 + 1e-9), (b, r, other)


def test_auto_uses_the_regime_tree_at_each_batch(net, compiled, table):
    for b in (1, 2, 3, 15, 16, 17, 256, 257, 4096):
        assert compiled.plan_for(bind(net, b), ALL_GRAD).tree == table.tree_for(b)


def test_plan_table_mentions_gemm(net, compiled):
    text = compiled.plan_for(bind(net, 4096), ALL_GRAD).table()
    assert "gemm" in text
    assert "fwd" in text and "bwd" in text
    assert "permute copies 0.00 MB" in text
    first = compiled.plan_for(bind(net, 1), ALL_GRAD).table()
    assert "gemm" in first


def test_inspect_report(net):
    report = tncomp.inspect(net, disk_cache=False)
    assert "regimes" in report
    assert "vs dense" in report
    assert "forward FLOPs" in report and "B" in report
    assert "gemm" in report
    # dense 768x3072 weight vs the cores' parameters
    params = 144 + 2880 + 7200 + 10800 + 7680 + 256
    assert f"{768 * 3072:,} parameters; cores {params:,}" in report


def test_inspect_of_compiled_network_and_fixed_sizes(compiled):
    assert "regimes" in tncomp.inspect(compiled, batch=64)
    fixed = tncomp.inspect(tncomp.from_eq("ij,jk->ik", (3, 4), (4, 5)), disk_cache=False)
    assert "all sizes fixed" in fixed and "gemm" in fixed


def test_layer_call_matches_the_dense_weight(compiled):
    """A real call (float32, all gradients: the fixture's regime table) equals x @ W."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(1, 12, 12), (12, 8, 30), (30, 8, 30), (30, 12, 30), (30, 16, 16), (16, 16, 1)]
    cores = [(torch.randn(s, generator=gen) / s[-1] ** 0.5).requires_grad_() for s in shapes]
    x = torch.randn(300, 12, 8, 8, generator=gen, requires_grad=True)
    with torch.no_grad():
        w = torch.einsum("aib,bjc,ckd,dle,emf,fng->ijklmn", *cores).reshape(768, 3072)
        want = x.reshape(300, 768) @ w
    y = compiled(x, *cores)
    assert y.requires_grad
    torch.testing.assert_close(y.detach().reshape(300, 3072), want, rtol=1e-4, atol=1e-4)


def _contractions(tree):
    """The pairwise contractions of a tree as leaf sets, ignoring step and child order."""
    covers = tree.leaves_under()
    return frozenset(frozenset({covers[a], covers[b]}) for a, b in tree.steps)


def test_neighbouring_regimes_of_the_ffn_layer_contract_differently(table):
    regimes = table.regimes
    for a, b in itertools.pairwise(regimes):
        assert _contractions(a.tree) != _contractions(b.tree), (a, b)


def test_no_breakpoint_between_equivalent_trees():
    f = compile_net(tncomp.tt_linear([3, 5], [2, 7], 3))
    table = f.regimes()
    for a, b in itertools.pairwise(table.regimes):
        assert _contractions(a.tree) != _contractions(b.tree), (a, b)
