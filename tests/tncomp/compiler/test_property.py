"""Property tests: random einsum networks compile to what torch.einsum computes, both ways.

Networks have 1-5 operands; each index sits on 1-3 of them (so lone indices summed within one
operand, ordinary bonds and hyperedges all occur), sizes are 1-4 (size-1 indices included),
and the output keeps a random subset of the indices in a random order (possibly none: a
scalar). Operands may end up with no index at all (0-d tensors).

Examples per run: MAX_EXAMPLES for the int-sized property, SYMBOLIC_EXAMPLES for the one with a
symbolic batch index (whose regime table is built per example).
"""

from __future__ import annotations

import string

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tncomp
from tests.helpers.tn import F64
from tncomp.compiler.problem import Tree

MAX_EXAMPLES = 250
SYMBOLIC_EXAMPLES = 25
TOL = {"rtol": 1e-9, "atol": 1e-9}


@st.composite
def networks(draw, symbolic: bool = False):
    """(eq, shapes, concrete shapes): an einsum equation with sizes for from_eq and for torch."""
    n_ops = draw(st.integers(1, 5))
    n_idx = draw(st.integers(1, 6))
    letters = string.ascii_lowercase[:n_idx]
    terms: list[list[str]] = [[] for _ in range(n_ops)]
    sizes = {}
    for c in letters:
        sizes[c] = draw(st.integers(1, 4))
        holders = draw(st.lists(st.integers(0, n_ops - 1), min_size=1, max_size=min(3, n_ops),
                                unique=True))
        for h in holders:
            terms[h].append(c)
    terms = [draw(st.permutations(t)) for t in terms]
    present = sorted({c for t in terms for c in t})
    out = draw(st.lists(st.sampled_from(present), unique=True)) if present else []
    eq = ",".join("".join(t) for t in terms) + "->" + "".join(out)
    concrete = [tuple(sizes[c] for c in t) for t in terms]
    declared = concrete
    if symbolic and present:
        batch = draw(st.sampled_from(present))  # one index becomes the symbol "B"
        declared = [tuple("B" if c == batch else sizes[c] for c in t) for t in terms]
    return eq, declared, concrete


def _check(eq, declared, concrete, optimize, seed):
    net = tncomp.from_eq(eq, *declared)
    f = tncomp.compile(net, optimize=optimize, disk_cache=False)
    gen = torch.Generator().manual_seed(seed)
    ts = [torch.randn(s, generator=gen, dtype=F64, requires_grad=True) for s in concrete]
    refs = [t.detach().clone().requires_grad_() for t in ts]
    y = f(*ts)
    ry = torch.einsum(eq, *refs)
    assert y.shape == ry.shape
    torch.testing.assert_close(y, ry, **TOL)
    dy = torch.randn(ry.shape, generator=gen, dtype=F64)
    got = torch.autograd.grad(y, ts, dy)
    want = torch.autograd.grad(ry, refs, dy)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == ts[k].shape, f"operand {k}"
        torch.testing.assert_close(g, w, **TOL, msg=lambda m, k=k: f"grad of operand {k}: {m}")
    with torch.no_grad():
        torch.testing.assert_close(f(*ts), ry.detach(), **TOL)


@settings(max_examples=MAX_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=networks(), optimize=st.sampled_from(["auto", "search", "flops"]),
       seed=st.integers(0, 2**16))
def test_random_networks_match_einsum(case, optimize, seed):
    _check(*case, optimize, seed)


@settings(max_examples=SYMBOLIC_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=networks(symbolic=True), seed=st.integers(0, 2**16))
def test_random_networks_with_a_symbolic_size_match_einsum(case, seed):
    _check(*case, "auto", seed)


@st.composite
def trees(draw):
    """A random SSA contraction tree over 1-8 leaves."""
    n = draw(st.integers(1, 8))
    live = list(range(n))
    steps = []
    for k in range(n - 1):
        i, j = draw(st.lists(st.integers(0, len(live) - 1), min_size=2, max_size=2, unique=True))
        a, b = live[i], live[j]
        live = [v for v in live if v not in (a, b)] + [n + k]
        steps.append((a, b))
    return Tree(n, tuple(steps))


@settings(max_examples=200, deadline=None)
@given(tree=trees())
def test_linear_path_round_trip(tree):
    path = tree.to_linear_path()
    assert len(path) == max(tree.n_leaves - 1, 0)
    again = Tree.from_linear_path(tree.n_leaves, path)
    assert again.leaves_under()[again.root] == frozenset(range(tree.n_leaves))
    # the same contractions (as leaf sets), in the same order
    assert again.leaves_under() == tree.leaves_under()
