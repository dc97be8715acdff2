"""One compiled network called from several threads at once: every call gets its own result.

The pooled output buffers (tncomp/runtime/buffers.py) are shared by every call of a plan. Before
``BufferPool.take`` held a lock, a thread switch between its "is this storage free?" check and
the new reference handed one buffer to two calls, and one call's output silently turned into
another's (issue 11). The switch interval is cut to a microsecond here so threads switch often
and the race shows within a few hundred calls.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable

import pytest
import torch

import tncomp
from tests.helpers.tn import F64, compile_net, operands, reference

N_THREADS = 4


@contextlib.contextmanager
def switch_interval(seconds: float):
    previous = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def _run_threads(work: Callable[[int], None], n: int = N_THREADS) -> None:
    errors: list[BaseException] = []

    def guarded(t: int) -> None:
        try:
            work(t)
        except BaseException as exc:  # re-raised in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


# The unpooled run is the control: it never failed, so fewer calls suffice.
@pytest.mark.parametrize(("pool_buffers", "calls"), [(True, 300), (False, 100)],
                         ids=["pooled", "unpooled"])
def test_threads_never_share_an_output_buffer(one_thread, pool_buffers, calls):
    # A 128x512 float32 result (256 KiB) is pooled; K=1 keeps the GEMM short, so the threads
    # spend their time in the dispatch code where the race was.
    f = tncomp.compile(tncomp.from_eq("bi,ij->bj", (128, 1), (1, 512)), disk_cache=False,
                       pool_buffers=pool_buffers)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(1, 512, generator=gen)
    xs = [torch.randn(128, 1, generator=gen) for _ in range(8)]
    refs = [x @ w for x in xs]
    wrong = [0] * N_THREADS

    def work(t: int) -> None:
        kept: list[tuple[int, torch.Tensor]] = []  # the last 3 outputs stay alive
        with torch.no_grad():
            for k in range(calls):
                i = (k + t) % len(xs)
                kept.append((i, f(xs[i], w)))
                if len(kept) > 3:
                    j, y = kept.pop(0)
                    wrong[t] += not torch.allclose(y, refs[j], rtol=1e-6, atol=1e-6)

    with switch_interval(1e-6):  # at 1e-5 the old code passed on a 2-core machine
        _run_threads(work)
    assert sum(wrong) == 0, f"{sum(wrong)} outputs were overwritten by another thread's call"
    if pool_buffers:
        runner = next(iter(f._local.values()))
        assert runner.code.pools, "the 256 KiB result should come from a pooled buffer"
        assert all(len(p) <= p.limit for p in runner.code.pools.values())


def test_threads_share_one_compiled_network_under_autograd(one_thread):
    # Results of 512x64 float64 (256 KiB) come from pooled buffers, forward and backward.
    net = tncomp.tt_linear([8, 8], [8, 8], 4)
    f = compile_net(net)
    inputs = [operands(net, 512, seed=s, requires_grad=True) for s in range(N_THREADS)]
    wanted = []
    for ts in inputs:
        refs = [t.detach().clone().requires_grad_() for t in ts]
        y = reference(net, refs)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=F64)
        wanted.append((y.detach(), torch.autograd.grad(y, refs, dy), dy))
    mismatches: list[str] = []

    def work(t: int) -> None:
        ts = inputs[t]
        y_ref, g_ref, dy = wanted[t]
        for k in range(8):
            y = f(*ts)
            grads = torch.autograd.grad(y, ts, dy)
            if not torch.allclose(y, y_ref, rtol=1e-10, atol=1e-10):
                mismatches.append(f"thread {t} call {k}: output")
            for n, (g, r) in enumerate(zip(grads, g_ref, strict=True)):
                if not torch.allclose(g, r, rtol=1e-10, atol=1e-10):
                    mismatches.append(f"thread {t} call {k}: gradient of operand {n}")

    with switch_interval(1e-5):
        _run_threads(work)
    assert not mismatches, mismatches[:5]
