"""BoolMaskDropout: nn.Dropout's results, gradients and random stream, with a one-byte mask."""

import pytest
import torch
from torch import nn

from comera.models.dropout import BoolMaskDropout
from tests.helpers.saved import saved_by_autograd


@pytest.mark.parametrize("shape", [(7, 5), (2, 128, 768), (4, 3, 33, 17)])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_bit_identical_to_nn_dropout_with_a_quarter_of_the_saved_bytes(shape, p):
    x = torch.randn(*shape)
    runs = {}
    for cls in (nn.Dropout, BoolMaskDropout):
        xr = x.clone().requires_grad_()
        torch.manual_seed(3)
        y, saved = saved_by_autograd(cls(p), xr)
        after = torch.rand(4)  # the generator is left where nn.Dropout leaves it
        y.backward(torch.arange(y.numel(), dtype=y.dtype).view_as(y))
        runs[cls] = (y, xr.grad, after, saved)
    (y0, g0, r0, s0), (y1, g1, r1, s1) = runs[nn.Dropout], runs[BoolMaskDropout]
    assert torch.equal(y1, y0) and torch.equal(g1, g0) and torch.equal(r1, r0)
    assert s0 == 4 * x.numel() and s1 == x.numel()


def test_eval_and_p_zero_are_the_identity_and_compile_traces_it():
    x = torch.randn(3, 8)
    drop = BoolMaskDropout(0.3).eval()
    assert torch.equal(drop(x), x)
    assert torch.equal(BoolMaskDropout(0.0).train()(x), x)
    train = BoolMaskDropout(0.3).train()
    out = torch.compile(train, backend="aot_eager", fullgraph=True)(x)
    kept = out != 0
    torch.testing.assert_close(out[kept], x[kept] / 0.7)
