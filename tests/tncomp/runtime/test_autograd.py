"""tncomp.runtime.autograd: what the autograd Functions hand back to callers."""

import pytest
import torch

import tncomp


def test_unpooled_results_are_base_tensors_the_caller_may_add_into():
    """A result that is a view of a fresh GEMM output comes back as a base tensor, so an in-place
    add under autograd is allowed (comera adds biases this way) and leaves the gradients exact;
    a result that is a view of an operand stays a view, so an in-place add cannot silently
    change the caller's input."""
    net = tncomp.tt_linear((2, 3), (3, 2), 2)
    layer = tncomp.compile(net, disk_cache=False, pool_buffers=False)
    ops = [torch.randn(*[5 if isinstance(s, tncomp.Dim) else s for s in net.shape(t)],
                       dtype=torch.float64, requires_grad=True) for t in net.operands]
    y = layer(*ops)
    assert not y._is_view()
    y.add_(1.0)
    got = torch.autograd.grad(y.square().sum(), ops)
    want_y = layer(*ops) + 1.0
    want = torch.autograd.grad(want_y.square().sum(), ops)
    torch.testing.assert_close(y, want_y)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)

    same = tncomp.compile(tncomp.from_eq("bi->bi", ("B", 4)), disk_cache=False,
                          pool_buffers=False)
    x = torch.randn(3, 4, requires_grad=True)
    before = x.detach().clone()
    out = same(x)
    assert out._is_view() and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    with pytest.raises(RuntimeError):
        out.add_(1.0)
    assert torch.equal(x.detach(), before)
