"""comera.lean.sdpa: torch's attention, bit for bit, with a backward that keeps q, k, v and a bool
mask (and torch's own function wherever the lean path does not apply)."""

import pytest
import torch
import torch.nn.functional as F

from benchmarks.lib.memory import held_bytes
from comera.lean.sdpa import scaled_dot_product_attention
from tests.helpers.memory import profiled_peak
from tests.helpers.saved import saved_by_autograd

B, S, H, D = 3, 33, 4, 16


def _inputs(dtype=torch.float32, seed=0):
    """A projection output (b, s, 3*h*d) and q, k, v as the per-head transposed views of it
    that attention layers pass (not contiguous)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, 3 * H * D, generator=g, dtype=dtype).requires_grad_()
    q, k, v = (t.view(B, S, H, D).transpose(1, 2) for t in x.split(H * D, -1))
    return x, q, k, v


def _mask(kind, dtype=torch.float32):
    if kind == "none":
        return None
    if kind == "float":
        return torch.randn(B, H, S, S, generator=torch.Generator().manual_seed(1), dtype=dtype)
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, 20:] = False
    keep[2, :] = False  # a sequence with no real token: rows of zeros, as torch gives
    return keep[:, None, None, :]


def _run(fn, kind, dtype=torch.float32, p=0.1, **kw):
    x, q, k, v = _inputs(dtype)
    torch.manual_seed(5)
    out, saved = saved_by_autograd(
        lambda: fn(q, k, v, attn_mask=_mask(kind, dtype), dropout_p=p, **kw))
    after = torch.rand(3)  # where the generator is left
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
    out.backward(dy)
    return out, x.grad, after, saved


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["none", "bool", "float"])
def test_bit_identical_to_torch_and_saves_q_k_v_and_a_bool_mask(threads, dtype, kind):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out0, grad0, after0, saved0 = _run(F.scaled_dot_product_attention, kind, dtype)
        out1, grad1, after1, saved1 = _run(scaled_dot_product_attention, kind, dtype)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out1, out0) and torch.equal(grad1, grad0) and torch.equal(after1, after0)
    size = torch.finfo(dtype).bits // 8
    mask_saved = {"none": 0, "bool": B * S * size, "float": B * H * S * S * size}[kind]
    assert saved1 == 3 * B * H * S * D * size + B * H * S * S + mask_saved  # q, k, v, keep
    assert saved0 >= 3 * B * H * S * S * size  # torch: probs, float noise, dropped probs


def test_an_explicit_scale_is_torchs_too():
    out0, grad0, _, _ = _run(F.scaled_dot_product_attention, "bool", scale=0.3)
    out1, grad1, _, _ = _run(scaled_dot_product_attention, "bool", scale=0.3)
    assert torch.equal(out1, out0) and torch.equal(grad1, grad0)


def test_gradcheck_and_gradgradcheck():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])[:, None, None, :]

    def attend(q, k, v):
        torch.manual_seed(0)  # the same dropout mask on every call
        return scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.2)

    assert torch.autograd.gradcheck(attend, (q, k, v))
    assert torch.autograd.gradgradcheck(attend, (q, k, v))


def test_it_holds_less_between_forward_and_backward_and_peaks_no_higher():
    b, s, h, d = 8, 128, 4, 32
    x = torch.randn(b, s, 3 * h * d, requires_grad=True)
    mask = torch.ones(b, 1, 1, s, dtype=torch.bool)
    scores = b * h * s * s * 4  # bytes of one (b, h, s, s) float tensor

    def forward(fn):
        q, k, v = (t.view(b, s, h, d).transpose(1, 2) for t in x.split(h * d, -1))
        return fn(q, k, v, attn_mask=mask, dropout_p=0.1)

    held, peak = {}, {}
    for fn in (F.scaled_dot_product_attention, scaled_dot_product_attention):
        held[fn] = held_bytes(lambda fn=fn: forward(fn))
        peak[fn] = profiled_peak(lambda fn=fn: forward(fn).sum().backward())
    torch_held, lean_held = held.values()
    output = b * s * h * d * 4
    additive = b * s * 4  # the bool key mask as torch's additive float mask, (b, 1, 1, s)
    assert lean_held == output + scores // 4 + additive  # no (b, h, s, s) float tensor
    assert torch_held >= output + 3 * scores  # probs, float noise, dropped probs (and copies)
    torch_peak, lean_peak = peak.values()
    assert lean_peak <= torch_peak  # the backward's recompute stays under torch's saves


@pytest.mark.parametrize("case", ["eval", "no_grad", "autocast", "causal"])
def test_elsewhere_it_is_torchs_function(case):
    """Where the lean path does not apply the call is torch's own: the same values, dtype and
    random stream."""
    _, q, k, v = _inputs()
    mask = None if case == "causal" else _mask("bool")
    p = 0.0 if case == "eval" else 0.1
    kw = {"is_causal": True} if case == "causal" else {}
    ctx = {"no_grad": torch.no_grad(),
           "autocast": torch.autocast("cpu", dtype=torch.bfloat16)}.get(case)
    results = []
    for fn in (F.scaled_dot_product_attention, scaled_dot_product_attention):
        torch.manual_seed(3)
        with ctx if ctx is not None else torch.enable_grad():
            out = fn(q, k, v, attn_mask=mask, dropout_p=p, **kw)
        results.append((out, torch.rand(2)))
    (out0, after0), (out1, after1) = results
    assert out1.dtype == out0.dtype and torch.equal(out1, out0) and torch.equal(after1, after0)


def test_compile_and_torch_func_trace_torchs_function():
    _, q, k, v = _inputs()
    q, k, v = (t.detach().clone() for t in (q, k, v))
    mask = _mask("bool")

    def attend(q, k, v):
        return scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0).sum()

    want = torch.func.grad(lambda q: F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask).sum())(q)
    torch.testing.assert_close(torch.func.grad(attend)(q, k, v), want)
    compiled = torch.compile(lambda q: scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=0.1), backend="aot_eager", fullgraph=True)
    out = compiled(q.requires_grad_())
    out.sum().backward()
    assert out.shape == (B, H, S, D) and q.grad is not None and torch.isfinite(q.grad).all()
