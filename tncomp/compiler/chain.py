"""Contraction orders of chain networks, by dynamic programming over intervals.

TT layers are chains: cores joined by their bonds ``r_k`` in a line, and at most one *hub*
operand (the input ``x``) attached to some of them (the input-side cores of a TT layer, every
core of a TT-matrix layer). An exact search over subsets costs exponential time in the number of
cores (a cold rank-16 plan took 22 s at d=6 and 128 s at d=7); here every node of a tree is an
interval of the chain, alone or with the hub, so a dynamic program over the O(n^2) intervals
finds the best tree of that family in O(n^3) steps, for each of a few objectives.

The family leaves out only trees in which the hub absorbs two intervals that are not adjacent:
such a node keeps the bond indices of both gaps, and it loses to the adjacent order in every
case we compared against the exact search (``tests/tncomp/compiler/test_chain.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from tncomp.compiler.problem import Problem, Tree

# Objectives the chain search minimises, each giving one candidate tree. Modelled time uses
# ``max(flops / rate, bytes / bandwidth) + overhead`` per GEMM (forward, then one GEMM per child
# adjoint) at these (FLOP/s, bytes/s, seconds per step): the CPU and CUDA defaults of
# ``device_model`` and a bandwidth-starved device; the device model picks among the results.
TIME_RATES = ((100e9, 10e9, 6e-6), (50e12, 2e12, 8e-6), (100e9, 2e9, 6e-6))


@dataclass(frozen=True, slots=True)
class Chain:
    """A network seen as a chain: ``path`` lists the chain's leaves in order; ``hub`` is the one
    leaf attached off the chain (None for a bare chain)."""

    path: tuple[int, ...]
    hub: int | None


def _bond_graph(problem: Problem) -> list[set[int]]:
    """Neighbours of every leaf: leaves sharing an index that is summed (not in the output)."""
    output = set(problem.output)
    holders: dict[str, list[int]] = {}
    for k, term in enumerate(problem.leaf_kept):
        for i in dict.fromkeys(term):
            if i not in output:
                holders.setdefault(i, []).append(k)
    graph: list[set[int]] = [set() for _ in range(problem.n_leaves)]
    for leaves in holders.values():
        for a in leaves:
            graph[a].update(b for b in leaves if b != a)
    return graph


def _as_path(graph: list[set[int]], nodes: list[int]) -> tuple[int, ...] | None:
    """The nodes in path order if their induced subgraph is one simple path, else None."""
    members = set(nodes)
    degree = {v: len(graph[v] & members) for v in nodes}
    if len(nodes) == 1:
        return tuple(nodes)
    ends = [v for v in nodes if degree[v] == 1]
    if len(ends) != 2 or any(d > 2 or d == 0 for d in degree.values()):
        return None
    order, prev, here = [ends[0]], None, ends[0]
    while len(order) < len(nodes):
        step = [v for v in graph[here] & members if v != prev]
        if len(step) != 1:
            return None
        prev, here = here, step[0]
        order.append(here)
    return tuple(order)


def find_chain(problem: Problem) -> Chain | None:
    """The chain structure of ``problem`` (a path of leaves plus at most one hub), or None."""
    n = problem.n_leaves
    if n < 3:
        return None
    graph = _bond_graph(problem)
    path = _as_path(graph, list(range(n)))
    if path is not None:
        return Chain(path, None)
    for hub in sorted(range(n), key=lambda k: -len(graph[k])):
        if not graph[hub]:
            continue
        path = _as_path(graph, [k for k in range(n) if k != hub])
        if path is not None:
            return Chain(path, hub)
    return None


# A step cost: (flops of the pairwise GEMM, elements of left, right and result, whether the
# left / right child needs an adjoint) -> cost; costs of a tree are summed.
StepCost = Callable[[float, float, float, float, bool, bool], float]


def flops_cost(backward: bool) -> StepCost:
    """FLOPs of the forward GEMM, plus one GEMM per child adjoint when ``backward``."""
    def cost(flops, left, right, out, adj_left, adj_right):
        return flops * (1 + (adj_left + adj_right if backward else 0))

    return cost


def time_cost(rate: float, bandwidth: float, overhead: float, itemsize: int = 4) -> StepCost:
    """Modelled seconds of the forward GEMM and the child adjoints' GEMMs (no copies)."""
    def cost(flops, left, right, out, adj_left, adj_right):
        one = max(flops / rate, (left + right + out) * itemsize / bandwidth) + overhead
        return one * (1 + adj_left + adj_right)

    return cost


# A state is an interval ``a..b`` of the path (inclusive) with or without the hub; a move makes
# it from two states: ((a, m, left_hub), (m + 1, b, right_hub)), or ("hub", (a, b, False)) for
# the hub joining the bare interval.
State = tuple[int, int, bool]


@dataclass(frozen=True, slots=True)
class _Move:
    """One way to make a state: its two children, the index sets of the step (both children,
    left, right, result) and whether each child needs an adjoint."""

    left: State | str
    right: State
    union: frozenset[str]
    left_kept: frozenset[str]
    right_kept: frozenset[str]
    out_kept: frozenset[str]
    adj_left: bool
    adj_right: bool


@lru_cache(maxsize=32)
def _structure(leaf_kept: tuple[tuple[str, ...], ...], output: tuple[str, ...], chain: Chain,
               grads: tuple[bool, ...]) -> tuple[tuple[State, tuple[_Move, ...]], ...]:
    """Every state of the chain, shortest first, with the moves that make it; moves that would
    be outer products are left out. Sizes play no part, so the regime search's samples of one
    network share it (bounded cache)."""
    n_leaves = len(leaf_kept)
    grad_mask = sum(1 << k for k, g in enumerate(grads) if g)
    owners: dict[str, int] = {}
    for k, term in enumerate(leaf_kept):
        for i in term:
            owners[i] = owners.get(i, 0) | (1 << k)
    out = set(output)
    kept_of: dict[int, frozenset[str]] = {}

    def kept(mask: int) -> frozenset[str]:
        if mask not in kept_of:
            indices = {i for k in range(n_leaves) if mask >> k & 1 for i in leaf_kept[k]}
            kept_of[mask] = frozenset(i for i in indices if i in out or owners[i] & ~mask)
        return kept_of[mask]

    path, hub = chain.path, chain.hub
    n = len(path)
    prefix = [0]
    for leaf in path:
        prefix.append(prefix[-1] | (1 << leaf))
    hub_bit = 0 if hub is None else 1 << hub

    def mask(state: State | str) -> int:
        if state == "hub":
            return hub_bit
        a, b, with_hub = state
        return (prefix[b + 1] & ~prefix[a]) | (hub_bit if with_hub else 0)

    table = []
    for length in range(1, n + 1):
        for a in range(n - length + 1):
            b = a + length - 1
            for with_hub in ((False, True) if hub is not None else (False,)):
                state = (a, b, with_hub)
                pairs: list[tuple[State | str, State]] = []
                for m in range(a, b):
                    pairs.append(((a, m, with_hub), (m + 1, b, False)))
                    if with_hub:
                        pairs.append(((a, m, False), (m + 1, b, True)))
                if with_hub:
                    pairs.append(("hub", (a, b, False)))
                out_kept = kept(mask(state))
                moves = []
                for left, right in pairs:
                    lm, rm = mask(left), mask(right)
                    lk, rk = kept(lm), kept(rm)
                    if lk & rk:  # no outer products
                        moves.append(_Move(left, right, lk | rk, lk, rk, out_kept,
                                           bool(lm & grad_mask), bool(rm & grad_mask)))
                table.append((state, tuple(moves)))
    return tuple(table)


class _Moves:
    """The chain's states and moves with each step's raw numbers at the problem's sizes
    (FLOPs, element counts of both children and the result, the children's adjoint flags)."""

    def __init__(self, problem: Problem, chain: Chain, needs_grad: Sequence[bool] | None):
        grads = ((True,) * problem.n_leaves if needs_grad is None
                 else tuple(bool(g) for g in needs_grad))
        table = _structure(problem.leaf_kept, tuple(problem.output), chain, grads)
        self.n, self.has_hub = len(chain.path), chain.hub is not None
        volumes: dict[frozenset[str], float] = {}

        def vol(indices: frozenset[str]) -> float:
            if indices not in volumes:
                volumes[indices] = float(problem.volume(indices))
            return volumes[indices]

        self.order = [state for state, _ in table]
        self.moves = {
            state: [(m.left, m.right, (2 * vol(m.union), vol(m.left_kept), vol(m.right_kept),
                                       vol(m.out_kept), m.adj_left, m.adj_right))
                    for m in moves]
            for state, moves in table
        }

    def best_tree(self, problem: Problem, chain: Chain, cost: StepCost) -> Tree | None:
        best: dict[object, tuple[float, tuple | None]] = {"hub": (0.0, None)}
        for pos in range(self.n):
            best[(pos, pos, False)] = (0.0, None)
        for state in self.order:
            if state in best:
                continue
            choice, least = None, math.inf
            for left, right, raw in self.moves[state]:
                c = best[left][0] + best[right][0]
                if c < least:
                    c += cost(*raw)
                    if c < least:
                        choice, least = (left, right), c
            best[state] = (least, choice)
        root = (0, self.n - 1, self.has_hub)
        if best[root][0] == math.inf:
            return None
        steps: list[tuple[int, int]] = []
        n_leaves = problem.n_leaves

        def build(state) -> int:
            if state == "hub":
                return chain.hub
            choice = best[state][1]
            if choice is None:
                return chain.path[state[0]]
            left, right = build(choice[0]), build(choice[1])
            steps.append((left, right))
            return n_leaves + len(steps) - 1

        build(root)
        return Tree(n_leaves, tuple(steps))


def best_chain_tree(problem: Problem, chain: Chain, cost: StepCost,
                    needs_grad: Sequence[bool] | None = None) -> Tree | None:
    """The tree of least summed ``cost`` among those whose every node is an interval of the
    chain, with or without the hub; None when every such tree needs an outer product."""
    return _Moves(problem, chain, needs_grad).best_tree(problem, chain, cost)


# The objectives of :func:`chain_trees`: (name, step cost, whether the hub needs a gradient).
# The hub is the layer input x; a network's first layer takes no gradient for it.
OBJECTIVES: tuple[tuple[str, StepCost, bool], ...] = (
    ("forward flops", flops_cost(False), True),
    ("fwd+bwd flops", flops_cost(True), True),
    *((f"fwd+bwd time at {rate / 1e9:g} GFLOP/s, {bw / 1e9:g} GB/s", time_cost(rate, bw, over),
       True) for rate, bw, over in TIME_RATES),
    ("fwd+bwd time, x without gradient", time_cost(*TIME_RATES[0]), False),
)


def chain_trees(problem: Problem) -> list[Tree] | None:
    """Candidate trees of a chain network whose sizes are all ints: the interval family's best
    under each of :data:`OBJECTIVES`; None when ``problem`` is not a chain."""
    chain = find_chain(problem)
    if chain is None:
        return None
    moves: dict[bool, _Moves] = {}
    found: list[Tree] = []
    for _, cost, hub_grad in OBJECTIVES:
        if hub_grad not in moves:
            grads = [True] * problem.n_leaves
            if chain.hub is not None:
                grads[chain.hub] = hub_grad
            moves[hub_grad] = _Moves(problem, chain, grads)
        tree = moves[hub_grad].best_tree(problem, chain, cost)
        if tree is None:
            return None
        if tree.signature() not in {t.signature() for t in found}:
            found.append(tree)
    return found
