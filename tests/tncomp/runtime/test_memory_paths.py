"""A recomputing plan (``memory="min"``) on every call path: torch.compile, torch.func, autocast;
and torch.utils.checkpoint, which sees the saved intermediates through saved-tensor hooks."""

from __future__ import annotations

import torch
import torch._dynamo
import torch.utils.checkpoint

import tncomp
from tests.helpers.memory import profiled_peak
from tests.helpers.tn import compile_net, operands, reference

TOL = {"rtol": 1e-9, "atol": 1e-10}
NET = lambda: tncomp.tt_linear((4, 4, 4), (4, 4, 4), 8)  # noqa: E731


def _grads(f, ts):
    ts = [t.detach().clone().requires_grad_() for t in ts]
    y = f(*ts)
    return y, torch.autograd.grad(y.square().sum(), ts)


def test_min_under_torch_compile_matches_einsum(one_thread):
    net = NET()
    f = compile_net(net, memory="min")
    ts = operands(net, 16, seed=1)
    assert f.plan_of(*[t.requires_grad_() for t in ts]).recomputed
    torch._dynamo.reset()
    y, g = _grads(torch.compile(lambda *a: f(*a), fullgraph=True), ts)
    ry, rg = _grads(lambda *a: reference(net, a), ts)
    torch.testing.assert_close(y, ry, **TOL)
    torch.testing.assert_close(g, rg, **TOL)


def test_min_under_torch_func_matches_einsum(one_thread):
    net = NET()
    f = compile_net(net, memory="min")
    ts = operands(net, 8, seed=2)

    def loss(*a):
        return f(*a).square().sum()

    g = torch.func.grad(loss, argnums=tuple(range(len(ts))))(*ts)
    _, rg = _grads(lambda *a: reference(net, a), ts)
    torch.testing.assert_close(g, rg, **TOL)


def test_min_under_autocast_matches_fast(one_thread):
    net = NET()
    ts = operands(net, 8, seed=3, dtype=torch.float32)
    out = {}
    for memory in ("fast", "min"):
        f = compile_net(net, memory=memory)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out[memory] = _grads(f, ts)
    assert out["min"][0].dtype == torch.bfloat16
    torch.testing.assert_close(out["min"], out["fast"], rtol=0, atol=0)


def test_non_reentrant_checkpoint_recomputes_the_same_saved_tensors(one_thread):
    # checkpoint re-packs what the forward saved (operands and intermediates, all through
    # save_for_backward) and checks the recomputation saves the same tensors
    net = NET()
    f = compile_net(net)
    ts = operands(net, 16, seed=4)
    ck = lambda *a: torch.utils.checkpoint.checkpoint(f, *a, use_reentrant=False)  # noqa: E731
    y, g = _grads(ck, ts)
    ry, rg = _grads(lambda *a: reference(net, a), ts)
    torch.testing.assert_close(y, ry, **TOL)
    torch.testing.assert_close(g, rg, **TOL)


def test_min_lowers_the_profiled_peak_of_a_stack_by_the_saves_it_drops(one_thread):
    # Four layers in a row: "fast" holds every layer's intermediates until its backward, "min"
    # holds none and rebuilds one layer's at a time, so its peak is lower by at least three
    # layers' saves.
    net = tncomp.tt_linear((4, 4, 4), (4, 4, 4), 16)
    ts = operands(net, 16, requires_grad=True)
    peaks, saved = {}, {}
    for memory in ("fast", "min"):
        f = compile_net(net, memory=memory, optimize="search", pool_buffers=False)
        saved[memory] = f.plan_of(*ts).saved_bytes

        def step(f=f):
            h = ts[0]
            for _ in range(4):
                h = f(h, *ts[1:])
            h.sum().backward()

        step()
        peaks[memory] = profiled_peak(step)
    assert saved["min"] == 0 < saved["fast"]
    assert peaks["fast"] - peaks["min"] >= 3 * saved["fast"]
