"""stack_siblings: n copies of a network sharing its inputs, as one network with a stack index
on every parameter and on the output (the q/k/v projections of attention as one contraction)."""

import pytest
import torch

import tncomp
from tests.helpers.tn import F64, operands, reference
from tncomp.compiler.builders import stack_siblings
from tncomp.errors import IRError

N = 3


def _per_sibling(net, stacked_ops):
    """The unstacked network's output for each sibling, through torch.einsum."""
    x, *params = stacked_ops
    return torch.stack([reference(net, [x, *(p[s] for p in params)]) for s in range(N)])


@pytest.mark.parametrize("build", [tncomp.tt_linear, tncomp.ttm_linear])
def test_stacked_network_is_each_sibling_and_its_gradients(build):
    net = build((2, 3, 2), (3, 2, 2), 3)
    stacked = stack_siblings(net, N)
    assert [t.indices[0] == "s" for t in stacked.operands] == [
        t.role is tncomp.Role.PARAMETER for t in net.operands]
    assert stacked.output.indices[0] == "s" and "s" in stacked.hyper
    ops = operands(stacked, 5, requires_grad=True)
    got = tncomp.compile(stacked, disk_cache=False)(*ops)
    want = _per_sibling(net, ops)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(want)
    grads = torch.autograd.grad(got, ops, dy)
    want_grads = torch.autograd.grad(want, ops, dy)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_gradcheck_on_a_tiny_stacked_network():
    stacked = stack_siblings(tncomp.tt_linear((2, 2), (2, 3), 2), 2)
    compiled = tncomp.compile(stacked, disk_cache=False)
    ops = operands(stacked, 3, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(compiled, tuple(ops))


def test_the_input_is_read_by_one_gemm():
    """At a large batch the planner contracts the input-side cores first and then x with all
    siblings' (r * n wide) matrix in one GEMM: x is read once."""
    stacked = stack_siblings(tncomp.tt_linear((12, 8, 8), (8, 8, 12), 30), N)
    compiled = tncomp.compile(stacked, disk_cache=False)
    ops = operands(stacked, 4096, dtype=torch.float32, requires_grad=True)
    plan = compiled.plan_of(*ops)
    readers = [op for op in plan.forward if 0 in getattr(op, "reads", ())]
    assert len(readers) == 1 and readers[0].lhs.shape.__len__() == 2, plan


def test_a_taken_index_name_gets_a_fresh_one():
    net = tncomp.make_network([("x", ["b", "s"], tncomp.Role.INPUT),
                               ("w", ["s", "j"], tncomp.Role.PARAMETER)],
                              ("y", ["b", "j"]), {"b": tncomp.Dim("B"), "s": 4, "j": 5})
    stacked = stack_siblings(net, 2)
    assert stacked.output.indices == ("s_", "b", "j")
    assert stacked.hyper == frozenset()  # on two tensors only: a plain index


@pytest.mark.parametrize(("n", "match"), [(0, "n=0"), (True, "n=True"), (2.0, "n=2.0")])
def test_bad_counts_are_refused(n, match):
    with pytest.raises(IRError, match=match):
        stack_siblings(tncomp.tt_linear((2, 2), (2, 2), 2), n)


def test_a_network_without_parameters_is_refused():
    net = tncomp.make_network([("x", ["i"], tncomp.Role.INPUT), ("y", ["i"], tncomp.Role.INPUT)],
                              ("z", []), {"i": 3})
    with pytest.raises(IRError, match="no parameter"):
        stack_siblings(net, 2)
