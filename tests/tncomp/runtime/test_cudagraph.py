"""The CUDA-graph path: agrees with eager, follows in-place parameter updates, re-captures on a
new shape, and counts captures. Skipped without CUDA."""

import pytest
import torch

import tncomp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _operands(net, batch, requires_grad=True):
    shapes = [[batch if isinstance(s, tncomp.Dim) else s for s in net.shape(t)]
              for t in net.operands]
    return [torch.randn(*s, device="cuda", requires_grad=requires_grad) for s in shapes]


def test_graph_matches_eager_and_follows_updates():
    net = tncomp.tt_linear((4, 8), (8, 4), 6)
    graphed = tncomp.compile(net, cuda_graphs=True, disk_cache=False)
    eager = tncomp.compile(net, disk_cache=False)
    ops = _operands(net, 32)
    for _ in range(3):
        y_graph = graphed(*ops)
        y_graph.sum().backward()
        g_graph = [o.grad.clone() for o in ops]
        for o in ops:
            o.grad = None
        y_eager = eager(*ops)
        y_eager.sum().backward()
        torch.testing.assert_close(y_graph, y_eager)
        for a, o in zip(g_graph, ops, strict=True):
            torch.testing.assert_close(a, o.grad)
            o.grad = None
        with torch.no_grad():  # an optimizer-like in-place update must be seen by the replay
            for o in ops[1:]:
                o.mul_(0.9)
    assert graphed.captures == 1


def test_new_shape_captures_again():
    net = tncomp.tt_linear((4, 8), (8, 4), 6)
    graphed = tncomp.compile(net, cuda_graphs=True, disk_cache=False)
    graphed(*_operands(net, 16)).sum().backward()
    graphed(*_operands(net, 16)).sum().backward()
    graphed(*_operands(net, 64)).sum().backward()
    assert graphed.captures == 2


def test_second_forward_before_backward_runs_eagerly_and_correctly():
    net = tncomp.tt_linear((4, 8), (8, 4), 6)
    graphed = tncomp.compile(net, cuda_graphs=True, disk_cache=False)
    eager = tncomp.compile(net, disk_cache=False)
    ops = _operands(net, 16)
    x2 = torch.randn_like(ops[0], requires_grad=True)
    (graphed(*ops).sum() + graphed(x2, *ops[1:]).sum()).backward()
    got = [o.grad.clone() for o in ops[1:]]
    for o in ops:
        o.grad = None
    (eager(*ops).sum() + eager(x2, *ops[1:]).sum()).backward()
    for a, o in zip(got, ops[1:], strict=True):
        torch.testing.assert_close(a, o.grad)


@pytest.mark.parametrize("which", ["tucker", "btt"])
def test_strided_batch_plans_replay_as_eager_and_einsum(which):
    """The layout-aware plans of issue 32 (strided-batch GEMMs, adjoints read in place) on the
    GPU: eager and replayed graphs agree with torch.einsum in float64, gradients included."""
    from tests.helpers.tn import reference
    from tests.tncomp.compiler.test_layouts import btt, tucker

    net = (tucker((3, 2, 2), (2, 3, 2), 2) if which == "tucker"
           else btt((3, 2, 2), (2, 3, 2), 2))
    eager = tncomp.compile(net, disk_cache=False)
    graphed = tncomp.compile(net, cuda_graphs=True, disk_cache=False)
    ops = [o.double().detach().requires_grad_() for o in _operands(net, 300)]
    expected = reference(net, ops)
    dy = torch.randn_like(expected)
    want = torch.autograd.grad(expected, ops, dy)
    for f in (eager, graphed, graphed):
        y = f(*ops)
        torch.testing.assert_close(y, expected)
        for got, w in zip(torch.autograd.grad(y, ops, dy), want, strict=True):
            torch.testing.assert_close(got, w)
    assert graphed.captures == 1
