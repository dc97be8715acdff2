"""tncomp/compiler/finders: the planner's candidates are the registered finders' trees, in
their order; a user's finder joins them, and a tree only it proposes is planned, chosen and
computes the right thing (float64, against torch.einsum)."""

from __future__ import annotations

import pytest
import torch

import tncomp
import tncomp.compiler.finders as finders
from tncomp.compiler.device_model import CPU_DEFAULT
from tncomp.compiler.problem import Tree, problem_for
from tncomp.compiler.search import candidate_trees, choose_plan
from tncomp.errors import PlanError
from tncomp.extend import SearchSpace, register_tree_finder

EQ = "ab,bc,cd,de->ae"
SHAPES = ((2, 3), (3, 4), (4, 5), (5, 6))
ODD = Tree(4, ((0, 3), (1, 2), (4, 5)))  # the two ends first: an outer product nobody proposes


@pytest.fixture
def registry(monkeypatch):
    """The registry as it is, restored after the test."""
    monkeypatch.setattr(finders, "_FINDERS", dict(finders._FINDERS))
    return finders._FINDERS


def _problem():
    return problem_for(tncomp.from_eq(EQ, *SHAPES))


def test_the_builtin_finders_are_asked_in_their_order():
    assert list(finders.tree_finders()) == ["chain", "optimal", "dp", "cotengra", "greedy",
                                            "layout_greedy", "sequential"]


def test_a_users_finder_joins_the_candidates_and_sees_the_problem(registry):
    seen = []

    def mine(space: SearchSpace):
        seen.append(space)
        return [ODD]

    before = candidate_trees(_problem())
    assert ODD.signature() not in {t.signature() for t in before}
    register_tree_finder("mine", mine)
    after = candidate_trees(_problem())
    assert after[:len(before)] == before and after[-1] == ODD  # asked last, after the others
    (space,) = seen
    assert space.n == 4 and space.sizes == {"a": 2, "b": 3, "c": 4, "d": 5, "e": 6}
    assert space.inputs == tuple(frozenset(t) for t in ("ab", "bc", "cd", "de"))


def test_a_tree_only_a_users_finder_proposes_is_planned_and_computes_the_einsum(registry):
    registry.clear()
    calls = []
    register_tree_finder("mine", lambda space: calls.append(space.n) or [ODD])
    problem = _problem()
    assert candidate_trees(problem) == [ODD]
    choice = choose_plan(problem, (True,) * 4, 8, CPU_DEFAULT)
    assert choice.plan.tree == ODD
    gen = torch.Generator().manual_seed(0)
    operands = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    tncomp.clear_cache()  # planned afresh: the only candidate is the user's tree
    calls.clear()
    out = tncomp.contract(EQ, *operands, disk_cache=False)
    assert calls  # the contraction was planned from the user's finder
    torch.testing.assert_close(out, torch.einsum(EQ, *operands))


def test_replace_keeps_the_place_and_a_second_name_is_refused(registry):
    register_tree_finder("greedy", lambda space: [], replace=True)
    assert list(finders.tree_finders()).index("greedy") == 4
    with pytest.raises(PlanError, match="registered already"):
        register_tree_finder("sequential", lambda space: [])
    with pytest.raises(PlanError, match="not callable"):
        register_tree_finder("mine", 3)
    with pytest.raises(PlanError, match="non-empty"):
        register_tree_finder("", lambda space: [])
