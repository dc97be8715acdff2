"""BoolMaskDropout: nn.Dropout's results, gradients and random stream, with a one-byte mask."""

import pytest
import torch
from torch import nn

from benchmarks.lib.memory import held_bytes
from comera.lean.dropout import BoolMaskDropout, kept
from tests.helpers.memory import profiled_peak
from tests.helpers.saved import saved_by_autograd


# (5, 301, 777) spans several of the product's slices, with a partial last one
@pytest.mark.parametrize("shape", [(7, 5), (2, 128, 768), (4, 3, 33, 17), (5, 301, 777)])
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


@pytest.mark.parametrize("threads", [1, 2])
def test_bit_identical_on_a_transposed_input_and_at_two_threads(threads):
    x = torch.randn(300, 900).t()  # not contiguous: native_dropout's own product
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runs = []
        for cls in (nn.Dropout, BoolMaskDropout):
            xr = x.clone().requires_grad_()
            torch.manual_seed(4)
            y = cls(0.2)(xr)
            y.backward(torch.ones_like(y))
            runs.append((y, xr.grad, torch.rand(2)))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_gradcheck_and_gradgradcheck():
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)

    def drop(x):
        torch.manual_seed(0)  # the same mask on every call
        return BoolMaskDropout(0.3)(x)

    assert torch.autograd.gradcheck(drop, (x,))
    assert torch.autograd.gradgradcheck(drop, (x,))


def test_forward_and_backward_allocate_only_their_results():
    """What the forward keeps is its output and a bool mask; the step's peak is the output, the
    mask, the incoming gradient and the input's gradient, plus one slice of the product
    (native_dropout converts the whole mask to a float temporary in both directions)."""
    n = 1 << 21  # eight slices
    x = torch.randn(n, requires_grad=True)
    dy = torch.randn(n)
    drop = BoolMaskDropout(0.1)
    held = held_bytes(lambda: drop(x))
    assert held == 4 * n + n  # the output and the mask

    def step():
        x.grad = None
        drop(x).backward(dy)

    def native_step():
        x.grad = None
        torch.native_dropout(x, 0.1, True)[0].backward(dy)

    # the timeline counts x and dy too (8n bytes)
    bound = 8 * n + 4 * n + n + 4 * n + 4 * (1 << 18)
    assert profiled_peak(step) <= bound < profiled_peak(native_step)


def test_kept_is_the_product_in_place_or_not_and_differentiable_where_recorded():
    x = torch.randn(1 << 19)
    keep = torch.rand(1 << 19) > 0.5
    want = x * keep
    assert torch.equal(kept(x, keep), want)
    y = x.clone()
    assert kept(y, keep, in_place=True) is y and torch.equal(y, want)
    xg = x.clone().requires_grad_()
    kept(xg, keep).sum().backward()
    assert torch.equal(xg.grad, keep.to(x.dtype))


def _ffn(seed: int, feed: bool, dtype=torch.float32):
    """drop(gelu(h)) into a linear layer, fed (its input rebuilt in the backward) or not."""
    torch.manual_seed(0)
    h = torch.randn(2, 64, 96, dtype=dtype, requires_grad=True)
    linear = nn.Linear(96, 40, dtype=dtype)
    drop = BoolMaskDropout(0.1)
    torch.manual_seed(seed)
    gelu = nn.functional.gelu
    if feed:
        y, saved = saved_by_autograd(lambda: drop.feed(gelu(h), linear, lambda: gelu(h)))
    else:
        y, saved = saved_by_autograd(lambda: linear(drop(gelu(h))))
    after = torch.rand(3)
    y.backward(torch.linspace(-1, 1, y.numel(), dtype=dtype).view_as(y))
    return (y, h.grad, linear.weight.grad, linear.bias.grad, after), saved


@pytest.mark.parametrize("threads", [1, 2])
def test_feed_is_bit_identical_and_does_not_keep_the_dropout_output(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fed, saved_fed = _ffn(5, feed=True)
        plain, saved_plain = _ffn(5, feed=False)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(fed, plain, strict=True):
        assert torch.equal(a, b)
    # the hook that counts saved bytes sits outside feed's own, so feed stands aside there
    assert saved_fed == saved_plain

    def forward(feed: bool):
        torch.manual_seed(1)
        h = torch.randn(2, 64, 96, requires_grad=True)
        linear, drop, gelu = nn.Linear(96, 40), BoolMaskDropout(0.1), nn.functional.gelu
        x = gelu(h)
        return drop.feed(x, linear, lambda: gelu(h)) if feed else linear(drop(x))

    held = held_bytes(lambda: forward(True))
    held_plain = held_bytes(lambda: forward(False))
    assert held_plain - held == 2 * 64 * 96 * 4  # the dropout's output


def test_feed_passes_gradcheck_and_gradgradcheck():
    h = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64)
    gelu = nn.functional.gelu

    def f(h):
        torch.manual_seed(0)  # the same mask on every call
        return BoolMaskDropout(0.3).feed(gelu(h), lambda d: torch.tanh(d @ w.t()),
                                         lambda: gelu(h))

    assert torch.autograd.gradcheck(f, (h,))
    assert torch.autograd.gradgradcheck(f, (h,))


@pytest.mark.parametrize("mode", ["eval", "no_grad", "autocast", "compile"])
def test_feed_is_the_plain_composition_where_it_cannot_rebuild(mode):
    h = torch.randn(4, 16)
    linear = nn.Linear(16, 8)
    drop = BoolMaskDropout(0.2).train(mode != "eval")
    gelu = nn.functional.gelu

    def both(hh):
        torch.manual_seed(2)
        fed = drop.feed(gelu(hh), linear, lambda: gelu(hh))
        torch.manual_seed(2)
        return fed, linear(drop(gelu(hh)))

    if mode == "no_grad":
        with torch.no_grad():
            fed, plain = both(h)
    elif mode == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fed, plain = both(h.requires_grad_())
    elif mode == "compile":
        fed, plain = torch.compile(both, backend="aot_eager")(h.requires_grad_())
    else:
        fed, plain = both(h)
    assert torch.equal(fed, plain)


def test_feed_leaves_a_tensor_that_x_again_returns_as_it_is():
    """``x_again`` may hand back a tensor something else holds (here ``x`` itself): the backward
    masks a copy of it, not the tensor."""
    x = torch.randn(4, 32, requires_grad=True)
    before = x.detach().clone()
    linear = nn.Linear(32, 8)
    torch.manual_seed(3)
    fed = BoolMaskDropout(0.2).feed(x, linear, lambda: x.detach())
    fed.sum().backward()
    grads = (x.grad.clone(), linear.weight.grad.clone())
    assert torch.equal(x.detach(), before)
    x.grad = None
    linear.weight.grad = None
    torch.manual_seed(3)
    linear(BoolMaskDropout(0.2)(x)).sum().backward()
    assert torch.equal(grads[0], x.grad) and torch.equal(grads[1], linear.weight.grad)
