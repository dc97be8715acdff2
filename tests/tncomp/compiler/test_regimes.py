"""Batch regimes pick the modelled best candidate at every batch, and no far worse tree.

On main the bisection compared each sample's winner with the previous sample's, not with the
regime's tree: when the winner changed twice between two samples (A, then B at the first edge,
then C by the next sample), B was kept to the end of the range. For the TT-matrix layer
[4,8,8]x[4,8,8] at rank 24 the table kept, from B=7 to 2^20, a tree modelled 7.6x slower than
the best candidate, with a 24x larger intermediate (6.4e9 elements at B=2^20).
"""

from __future__ import annotations

import math

import tncomp
from tncomp.compiler.device_model import CPU_DEFAULT, DeviceModel
from tncomp.compiler.ir import bind_dims
from tncomp.compiler.memory import apply_memory
from tncomp.compiler.plan import lower
from tncomp.compiler.problem import Tree, problem_for
from tncomp.compiler.regimes import build_regimes, regime_candidates
from tncomp.compiler.search import choose_plan, footprint, sound


def test_every_batch_gets_the_modelled_best_candidate():
    net = tncomp.ttm_linear([4, 8, 8], [4, 8, 8], 24)
    grads = (True,) * len(net.operands)
    table = build_regimes(net, grads, 4, CPU_DEFAULT)
    candidates = regime_candidates(net, grads, 4, CPU_DEFAULT)
    for batch in (1, 2, 3, 5, 6, 7, 8, 9, 64, 4096, 1 << 16, 1 << 20):
        problem = problem_for(net, bind_dims(net, batch))
        plans = [apply_memory(lower(problem, t, grads, 4, swaps=sw), "fast", CPU_DEFAULT)
                 for t, sw in candidates]
        times = [p.modelled_time(CPU_DEFAULT) if ok else math.inf
                 for p, ok in zip(plans, sound(plans, problem), strict=True)]
        chosen = next(k for k, (t, _) in enumerate(candidates) if t == table.tree_for(batch))
        assert times[chosen] == min(times), (batch, table)


def test_a_model_that_prefers_a_far_worse_tree_does_not_get_it():
    # a,b,c,d,ab,cd-> : the tree a(x)b, c(x)d, (ab)(x)(cd) makes N^4 elements; with every step
    # free but its overhead, a (planted) model times every tree alike and took the first.
    net = tncomp.from_eq("a,b,c,d,ab,cd->", (50,), (50,), (50,), (50,), (50, 50), (50, 50))
    problem = problem_for(net)
    bad = Tree(6, ((0, 1), (2, 3), (6, 7), (8, 4), (9, 5)))
    good = Tree(6, ((0, 4), (6, 1), (2, 5), (8, 3), (7, 9)))
    flat = DeviceModel(gemm_flops_per_s=1e30, bytes_per_s=1e30, step_overhead_s=1e-6)
    grads = (True,) * 6
    choice = choose_plan(problem, grads, 8, flat, [bad, good])
    assert choice.plan.tree == good
    assert [t for t, _ in choice.candidates] == [good]
    assert footprint(lower(problem, bad, grads, 8))[1] == 50 ** 4
