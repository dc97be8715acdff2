"""The planner's search budget (issue 26, item 2): no input of up to 64 operands plans for long.

Before the budget, ``contract`` over 16 disconnected vectors planned for 272 s, 14 for 18.5 s,
and ``tncomp inspect`` on a 14-operand spec with a batch symbol ran past 120 s; a random graph of
64 operands planned for about 100 s (cotengra's subtree reconfiguration, then the orientation
search of every candidate's lowering). Every result is checked against ``torch.einsum`` (through
``opt_einsum``'s pairwise torch contractions where an equation needs more than 52 labels), in
float64, gradients too. The time bounds are generous: the budget is 1 s per search.
"""

from __future__ import annotations

import io
import logging
import random
import time
from contextlib import redirect_stdout

import opt_einsum
import pytest
import torch

import tncomp
from tncomp import Role, make_network
from tncomp.cli import main
from tncomp.compiler.budget import BUDGET_ENV, Budget, budget_seconds
from tncomp.compiler.problem import problem_for
from tncomp.compiler.search import candidate_trees
from tncomp.errors import OptionError

BOUND_S = 10.0
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _vectors(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(n)]


def _check_grads(out: torch.Tensor, ref: torch.Tensor, operands) -> None:
    torch.testing.assert_close(out, ref)
    probe = torch.randn_like(ref)
    got = torch.autograd.grad(out, operands, probe)
    want = torch.autograd.grad(ref, operands, probe)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("n", [14, 16])
def test_disconnected_vectors_plan_within_the_bound(n):
    eq = ",".join(LETTERS[:n]) + "->"
    operands = _vectors(n)
    start = time.perf_counter()
    out = tncomp.contract(eq, *operands, disk_cache=False)
    elapsed = time.perf_counter() - start
    assert elapsed < BOUND_S, f"{n} vectors planned in {elapsed:.1f} s"
    _check_grads(out, torch.einsum(eq, *operands), operands)


def test_inspect_of_many_scalars_with_a_batch_symbol_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setenv("TNCOMP_CACHE_DIR", str(tmp_path))
    spec = "eq:Za,b,c,d,e,f,g,h,i,j,k,l,m,n->Z:B," + "|".join(["2"] * 14)
    start = time.perf_counter()
    with redirect_stdout(io.StringIO()) as text:
        assert main(["inspect", spec]) == 0
    elapsed = time.perf_counter() - start
    assert elapsed < BOUND_S, f"inspect ran {elapsed:.1f} s"
    assert "modelled time" in text.getvalue()


def _network(kind: str, n: int, seed: int = 0):
    """Operand index lists of a network kind with ``n`` operands, and its output."""
    if kind == "disconnected":
        return [[f"i{k}"] for k in range(n)], []
    if kind == "outer":
        return [[f"i{k}"] for k in range(n)], [f"i{k}" for k in range(12)]
    if kind == "chain":
        return [[f"i{k}", f"i{k + 1}"] for k in range(n)], []
    rng = random.Random(seed)  # a random connected graph: a spanning tree plus n // 2 edges
    terms: list[list[str]] = [[] for _ in range(n)]
    for edge in range(n - 1 + n // 2):
        a, b = (rng.randrange(edge + 1), edge + 1) if edge < n - 1 else rng.sample(range(n), 2)
        terms[a].append(f"e{edge}")
        terms[b].append(f"e{edge}")
    return terms, []


def _plan_and_check(kind: str, n: int) -> float:
    terms, output = _network(kind, n)
    labels = sorted({i for t in terms for i in t})
    net = make_network([(f"T{k}", t, Role.INPUT) for k, t in enumerate(terms)], ("out", output),
                       dict.fromkeys(labels, 2))
    gen = torch.Generator().manual_seed(n)
    operands = [torch.randn((2,) * len(t), generator=gen, dtype=torch.float64,
                            requires_grad=True) for t in terms]
    start = time.perf_counter()
    out = tncomp.compile(net, disk_cache=False)(*operands)
    elapsed = time.perf_counter() - start
    number = {i: k for k, i in enumerate(labels)}
    args = [x for t, term in zip(operands, terms, strict=True)
            for x in (t, [number[i] for i in term])]
    ref = opt_einsum.contract(*args, [number[i] for i in output], optimize="greedy",
                              backend="torch")
    _check_grads(out, ref, operands)
    return elapsed


def test_a_random_graph_of_64_operands_plans_within_the_bound():
    elapsed = _plan_and_check("random", 64)
    assert elapsed < BOUND_S, f"planned in {elapsed:.1f} s"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["disconnected", "outer", "chain", "random"])
@pytest.mark.parametrize("n", [16, 24, 40, 64])
def test_every_shape_up_to_64_operands_plans_within_the_bound(kind, n):
    elapsed = _plan_and_check(kind, n)
    assert elapsed < BOUND_S, f"{kind} of {n} planned in {elapsed:.1f} s"


def test_a_spent_budget_plans_greedily_and_says_so(caplog, monkeypatch):
    monkeypatch.setenv(BUDGET_ENV, "0")
    terms, output = _network("random", 12)
    labels = sorted({i for t in terms for i in t})
    net = make_network([(f"T{k}", t, Role.INPUT) for k, t in enumerate(terms)], ("out", output),
                       dict.fromkeys(labels, 3))
    problem = problem_for(net)
    with caplog.at_level(logging.INFO, logger="tncomp.compiler.budget"):
        trees = candidate_trees(problem)
    assert trees, "a spent budget still leaves the greedy and left-to-right trees"
    assert "ran out of its 0 s budget" in caplog.text
    assert "TNCOMP_PLAN_BUDGET_S" in caplog.text
    _plan_and_check("random", 12)  # and the plan computes the right thing


def test_a_generous_budget_keeps_the_exact_search():
    terms, output = _network("random", 8)
    labels = sorted({i for t in terms for i in t})
    net = make_network([(f"T{k}", t, Role.INPUT) for k, t in enumerate(terms)], ("out", output),
                       dict.fromkeys(labels, 3))
    budget = Budget(60.0)
    candidate_trees(problem_for(net), budget=budget)
    assert budget.ran_out == []


@pytest.mark.parametrize("raw", ["-1", "nan", "inf", "soon"])
def test_a_bad_budget_setting_is_refused_naming_it(monkeypatch, raw):
    monkeypatch.setenv(BUDGET_ENV, raw)
    with pytest.raises(OptionError, match=BUDGET_ENV):
        budget_seconds()
