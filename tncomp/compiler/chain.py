"""Contraction orders of chain networks, by dynamic programming over intervals.

TT layers are chains: cores joined by their bonds ``r_k`` in a line, and at most one *hub*
operand (the input ``x``) attached to some of them (the input-side cores of a TT layer, every
core of a TT-matrix layer). An exact search over subsets costs exponential time in the number of
cores (docs/results.md has cold planning times by d); here every node of a tree is an
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

import numpy as np

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
    """The chain structure of ``problem``, or None: its leaves joined by summed indices form a
    path, or a path plus one hub bonded to one contiguous run of it."""
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
        if path is None:
            continue
        # The hub must touch one run of the chain (x: the input-side cores). A hub joining
        # the two ends (a ring) would need nodes the interval family leaves out.
        touched = sorted(path.index(k) for k in graph[hub])
        if touched == list(range(touched[0], touched[-1] + 1)):
            return Chain(path, hub)
    return None


# A step cost, evaluated for all moves at once: (FLOPs of each pairwise GEMM, element counts of
# its left child, right child and result, whether the left / right child needs an adjoint) ->
# the cost of each move; the cost of a tree is the sum over its steps.
StepCost = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
                    np.ndarray]


def flops_cost(backward: bool) -> StepCost:
    """FLOPs of the forward GEMM, plus one GEMM per child adjoint when ``backward``."""
    def cost(flops, left, right, out, adj_left, adj_right):
        return flops * (1 + adj_left + adj_right) if backward else flops

    return cost


def time_cost(rate: float, bandwidth: float, overhead: float, itemsize: int = 4) -> StepCost:
    """Modelled seconds of the forward GEMM and the child adjoints' GEMMs (no copies)."""
    def cost(flops, left, right, out, adj_left, adj_right):
        one = np.maximum(flops / rate, (left + right + out) * (itemsize / bandwidth)) + overhead
        return one * (1 + adj_left + adj_right)

    return cost


@dataclass(frozen=True)
class _Structure:
    """The states of a chain and the moves that make them, independent of sizes.

    A state is an interval ``a..b`` of the path with or without the hub, numbered shortest
    first; state 0..n-1 are the path's leaves and state ``hub_state`` the hub alone. Move k
    makes state ``target[k]`` from ``left[k]`` and ``right[k]``; ``sets[*_set[k]]`` are the
    index sets of the step (both children, left, right, result); ``*_mask[k]`` the leaves
    under each child. Moves that would be outer products are left out.
    """

    states: tuple[tuple[int, int, bool], ...]
    hub_state: int
    first_move: tuple[int, ...]  # moves of state s: first_move[s] .. first_move[s + 1] - 1
    left: tuple[int, ...]
    right: tuple[int, ...]
    union_set: tuple[int, ...]
    left_set: tuple[int, ...]
    right_set: tuple[int, ...]
    out_set: tuple[int, ...]
    left_mask: tuple[int, ...]
    right_mask: tuple[int, ...]
    sets: tuple[tuple[str, ...], ...]


@lru_cache(maxsize=32)
def _structure(leaf_kept: tuple[tuple[str, ...], ...], output: tuple[str, ...],
               chain: Chain) -> _Structure:
    """The states and moves of ``chain`` (a bounded cache: the regime search's samples of one
    network share it, since sizes play no part)."""
    n_leaves = len(leaf_kept)
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

    set_ids: dict[frozenset[str], int] = {}

    def set_id(indices: frozenset[str]) -> int:
        return set_ids.setdefault(indices, len(set_ids))

    path, hub = chain.path, chain.hub
    n = len(path)
    prefix = [0]
    for leaf in path:
        prefix.append(prefix[-1] | (1 << leaf))
    hub_bit = 0 if hub is None else 1 << hub
    states: list[tuple[int, int, bool]] = [(p, p, False) for p in range(n)]
    if hub is not None:
        states.append((0, -1, True))  # the hub alone: an empty interval
    for length in range(2, n + 1):
        states += [(a, a + length - 1, False) for a in range(n - length + 1)]
    if hub is not None:
        for length in range(1, n + 1):
            states += [(a, a + length - 1, True) for a in range(n - length + 1)]
    # Order: by interval length, bare before hub, so every child precedes its parent.
    states.sort(key=lambda st: (st[1] - st[0], st[2]))
    index = {st: k for k, st in enumerate(states)}

    def mask(state: tuple[int, int, bool]) -> int:
        a, b, with_hub = state
        return (prefix[b + 1] & ~prefix[a] if b >= a else 0) | (hub_bit if with_hub else 0)

    cols: dict[str, list[int]] = {c: [] for c in (
        "left", "right", "union_set", "left_set", "right_set", "out_set", "left_mask",
        "right_mask")}
    first_move = []
    for a, b, with_hub in states:
        first_move.append(len(cols["left"]))
        if b - a + with_hub < 1:
            continue  # a leaf
        pairs = [((a, m, with_hub), (m + 1, b, False)) for m in range(a, b)]
        if with_hub:
            pairs += [((a, m, False), (m + 1, b, True)) for m in range(a, b)]
            pairs.append(((0, -1, True), (a, b, False)))
        out_kept = kept(mask((a, b, with_hub)))
        for lst, rst in pairs:
            lm, rm = mask(lst), mask(rst)
            lk, rk = kept(lm), kept(rm)
            if not lk & rk:
                continue  # an outer product
            for col, value in (("left", index[lst]), ("right", index[rst]),
                               ("union_set", set_id(lk | rk)), ("left_set", set_id(lk)),
                               ("right_set", set_id(rk)), ("out_set", set_id(out_kept)),
                               ("left_mask", lm), ("right_mask", rm)):
                cols[col].append(value)
    first_move.append(len(cols["left"]))
    sets = [tuple(sorted(s)) for s, _ in sorted(set_ids.items(), key=lambda kv: kv[1])]
    return _Structure(tuple(states), index.get((0, -1, True), -1), tuple(first_move),
                      *(tuple(cols[c]) for c in cols), tuple(sets))


class _Search:
    """The interval dynamic program of one chain problem at its bound sizes."""

    def __init__(self, problem: Problem, chain: Chain):
        self.problem, self.chain = problem, chain
        st = _structure(problem.leaf_kept, tuple(problem.output), chain)
        self.st = st
        sizes = problem.size_dict
        volumes = np.array([float(math.prod(sizes[i] for i in s)) for s in st.sets])
        self.flops = 2 * volumes[list(st.union_set)]
        self.sizes = (volumes[list(st.left_set)], volumes[list(st.right_set)],
                      volumes[list(st.out_set)])

    def adjoints(self, needs_grad: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
        """Whether each move's left and right child hold a leaf that needs a gradient."""
        grad_mask = sum(1 << k for k, g in enumerate(needs_grad) if g)
        return (np.array([bool(m & grad_mask) for m in self.st.left_mask], dtype=float),
                np.array([bool(m & grad_mask) for m in self.st.right_mask], dtype=float))

    def best_tree(self, cost: StepCost, needs_grad: Sequence[bool]) -> Tree | None:
        """The tree of least summed ``cost``; None when every tree needs an outer product."""
        st = self.st
        costs = cost(self.flops, *self.sizes, *self.adjoints(needs_grad)).tolist()
        left, right, first = st.left, st.right, st.first_move
        n_states = len(st.states)
        best = [0.0] * n_states
        choice = [-1] * n_states
        for s in range(n_states):
            lo, hi = first[s], first[s + 1]
            if lo == hi:
                a, b, with_hub = st.states[s]
                if b - a + with_hub >= 1:
                    best[s] = math.inf  # no move without an outer product
                continue
            least, pick = math.inf, -1
            for k in range(lo, hi):
                c = best[left[k]] + best[right[k]] + costs[k]
                if c < least:
                    least, pick = c, k
            best[s], choice[s] = least, pick
        root = n_states - 1
        if best[root] == math.inf:
            return None
        steps: list[tuple[int, int]] = []
        n_leaves = self.problem.n_leaves

        def build(s: int) -> int:
            k = choice[s]
            if k < 0:
                a, _, with_hub = st.states[s]
                return self.chain.hub if with_hub else self.chain.path[a]
            node_l, node_r = build(left[k]), build(right[k])
            steps.append((node_l, node_r))
            return n_leaves + len(steps) - 1

        build(root)
        return Tree(n_leaves, tuple(steps))


def best_chain_tree(problem: Problem, chain: Chain, cost: StepCost,
                    needs_grad: Sequence[bool] | None = None) -> Tree | None:
    """The tree of least summed ``cost`` among those whose every node is an interval of the
    chain, with or without the hub; None when every such tree needs an outer product.
    ``needs_grad`` (default: every operand) decides which children need an adjoint."""
    grads = [True] * problem.n_leaves if needs_grad is None else list(needs_grad)
    return _Search(problem, chain).best_tree(cost, grads)


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
    search = _Search(problem, chain)
    found: list[Tree] = []
    for _, cost, hub_grad in OBJECTIVES:
        grads = [True] * problem.n_leaves
        if chain.hub is not None:
            grads[chain.hub] = hub_grad
        tree = search.best_tree(cost, grads)
        if tree is None:
            return None
        if tree.signature() not in {t.signature() for t in found}:
            found.append(tree)
    return found
