"""Choosing among candidate trees: never a raw IndexError when every candidate looks far worse
than another on one count (issue 34, item 11: random 3-regular graphs of 200 tensors, where the
tree of fewest FLOPs and the tree of least memory were each 16x worse than the other)."""

from __future__ import annotations

import tncomp
import tncomp.compiler.search as search
from tncomp.compiler.device_model import CPU_DEFAULT
from tncomp.compiler.problem import problem_for


def _problem():
    return problem_for(tncomp.from_eq("ab,bc,cd->ad", (4, 5), (5, 6), (6, 7)))


def test_a_plan_is_chosen_when_every_candidate_is_far_worse_on_one_count(monkeypatch):
    problem = _problem()
    trees = search.candidate_trees(problem)
    assert len(trees) >= 2
    # the first tree: fewest FLOPs, 100x the memory; the others: the reverse
    feet = {trees[0]: (1, 10**9)}
    monkeypatch.setattr(search, "footprint",
                        lambda plan: feet.get(plan.tree, (10**9, 1)))
    choice = search.choose_plan(problem, (True,) * 3, 4, CPU_DEFAULT, trees)
    assert choice.plan.tree in trees
    ok = search.sound(list(choice.plans), problem)
    assert any(ok)


def test_the_pareto_front_is_kept_and_the_dominated_dropped(monkeypatch):
    problem = _problem()
    trees = search.candidate_trees(problem)[:3]
    plans = [search.lower(problem, t, (True,) * 3) for t in trees]
    feet = dict(zip(trees, [(1, 10**9), (10**9, 1), (10**9, 10**9)][:len(trees)], strict=False))
    monkeypatch.setattr(search, "footprint", lambda plan: feet[plan.tree])
    assert search.sound(plans, problem) == [True, True, False][:len(plans)]

