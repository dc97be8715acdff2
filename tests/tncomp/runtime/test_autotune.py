"""Autotune times the model's top candidates, keeps the fastest, and remembers it on disk."""

import torch

import tncomp
import tncomp.runtime.autotune as autotune


def _operands(net, batch):
    return [torch.randn(*[batch if isinstance(s, tncomp.Dim) else s for s in net.shape(t)],
                        dtype=torch.float64, requires_grad=True) for t in net.operands]


def test_autotuned_plan_is_correct_and_cached(tmp_path, monkeypatch):
    net = tncomp.tt_linear((3, 4), (4, 3), 5)
    tncomp.clear_cache()
    timed = []
    real = autotune._time_plan
    monkeypatch.setattr(autotune, "_time_plan", lambda *a, **k: timed.append(1) or real(*a, **k))
    f = tncomp.compile(net, autotune=True, disk_cache=tmp_path)
    ops = _operands(net, 6)
    y = f(*ops)
    ref = torch.einsum("bij,aip,pjq,qkr,rls->bkl", *ops)
    torch.testing.assert_close(y, ref)
    assert timed, "autotune should have timed candidate plans"
    assert any(tmp_path.iterdir())

    # A fresh process (cleared memory cache) with the same disk cache does not time again.
    tncomp.clear_cache()
    timed.clear()
    g = tncomp.compile(net, autotune=True, disk_cache=tmp_path)
    torch.testing.assert_close(g(*ops), ref)
    assert not timed


def test_gemm_orientation_is_measured_kept_on_disk_and_exact(tmp_path, monkeypatch):
    """Autotune times the heaviest GEMMs both ways; the orientations it picks are stored with
    the tree, so a fresh process rebuilds the same plan without timing again."""
    from tncomp.compiler.ops import MatMul

    net = tncomp.tt_linear((3, 4), (4, 3), 5)
    tncomp.clear_cache()
    timed = []
    real = autotune.gemm_times

    def transposed_wins(op, dtype, device, rounds=autotune.ORIENT_ROUNDS):
        timed.append(op)
        real(op, dtype, device, rounds=1)  # it runs in both orientations
        return 2.0, 1.0

    monkeypatch.setattr(autotune, "gemm_times", transposed_wins)
    ops = _operands(net, 6)
    f = tncomp.compile(net, autotune=True, disk_cache=tmp_path)
    plan = f.plan_of(*ops)
    marked = [op for op in (*plan.forward, *plan.backward) if isinstance(op, MatMul)
              and op.transposed]
    assert len(timed) == len(marked) == autotune.ORIENT_TOP
    assert {op.flops for op in marked} == {op.flops for op in timed}
    heaviest = max(op.flops for op in (*plan.forward, *plan.backward)
                   if isinstance(op, MatMul))
    assert any(op.flops == heaviest for op in marked)
    ref = torch.einsum("bij,aip,pjq,qkr,rls->bkl", *ops)
    dy = torch.randn(ref.shape, dtype=torch.float64)
    torch.testing.assert_close(f(*ops), ref)
    got = torch.autograd.grad(f(*ops), ops, dy)
    for g, w in zip(got, torch.autograd.grad(ref, ops, dy), strict=True):
        torch.testing.assert_close(g, w)

    tncomp.clear_cache()
    timed.clear()
    g = tncomp.compile(net, autotune=True, disk_cache=tmp_path)
    assert g.plan_of(*ops) == plan and not timed


def test_orient_gemms_names_gemms_of_the_plan():
    net = tncomp.tt_linear((3, 4), (4, 3), 5)
    ops = _operands(net, 64)
    plan = tncomp.compile(net, disk_cache=False).plan_of(*ops)
    fwd, bwd = autotune.orient_gemms(plan, torch.float64, "cpu", top=3)
    from tncomp.compiler.ops import MatMul

    assert all(isinstance(plan.forward[k], MatMul) for k in fwd)
    assert all(isinstance(plan.backward[k], MatMul) for k in bwd)
    assert len(fwd) + len(bwd) <= 3


def test_autotuned_choices_are_kept_per_cpu_thread_count(tmp_path, monkeypatch):
    net = tncomp.tt_linear((3, 4), (4, 3), 5)
    timed = []
    real = autotune._time_plan
    monkeypatch.setattr(autotune, "_time_plan", lambda *a, **k: timed.append(1) or real(*a, **k))
    ops = _operands(net, 6)
    before = torch.get_num_threads()
    try:
        for threads, fresh in ((1, True), (1, False), (2, True)):
            tncomp.clear_cache()
            timed.clear()
            torch.set_num_threads(threads)
            tncomp.compile(net, autotune=True, disk_cache=tmp_path)(*ops)
            assert bool(timed) == fresh, threads
    finally:
        torch.set_num_threads(before)


def test_autotune_under_memory_modes_is_exact_from_memory_and_from_disk(tmp_path):
    """An autotuned plan keeps its memory mode, also when a fresh process reads it from disk
    (the stored tree is lowered again, the mode applied, then the GEMM orientations)."""
    from tests.helpers import tn

    net = tncomp.ttm_linear([4, 4, 4], [4, 4, 4], 6)
    eq = tn.einsum_eq(net)
    saved = {}
    for memory in ("fast", "min", "balanced"):
        for _from_disk in (False, True):  # timed, then read back from the disk cache
            tncomp.clear_cache()
            f = tncomp.compile(net, autotune=True, memory=memory, disk_cache=tmp_path)
            ops = tn.operands(net, 64, requires_grad=True)
            grads = torch.autograd.grad(f(*ops).square().sum(), ops)
            refs = [o.detach().requires_grad_() for o in ops]
            want = torch.autograd.grad(torch.einsum(eq, *refs).square().sum(), refs)
            for got, ref in zip(grads, want, strict=True):
                torch.testing.assert_close(got, ref)
            saved.setdefault(memory, set()).add(f.plan_of(*ops).saved_bytes)
    assert all(len(v) == 1 for v in saved.values())  # the disk entry gives the same plan
    assert saved["min"] == {0} and saved["fast"].pop() > 0
