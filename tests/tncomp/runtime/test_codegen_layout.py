"""Codegen picks the fast CPU layout of a thin transposed GEMM (A^T B with few output columns
and a long inner size, the weight gradient of a low-rank TT layer), with unchanged values."""

import math

import torch

import tncomp
from tncomp.runtime.codegen import generate


def _layer(in_modes, out_modes, rank, batch, seed):
    """A compiled float64 TT layer, its operands at ``batch`` and its plan."""
    torch.manual_seed(seed)
    net = tncomp.tt_linear(in_modes, out_modes, rank)
    f = tncomp.compile(net, disk_cache=False)
    x = torch.randn(batch, *in_modes, dtype=torch.float64, requires_grad=True)
    cores = [torch.randn(*net.shape(t), dtype=torch.float64, requires_grad=True)
             for t in net.operands[1:]]
    return f, x, cores, f.plan_of(x, *cores)


def _einsum_grads(x, cores, dy):
    """torch.einsum's output and gradients of the d=3 TT layer (x, *cores)."""
    want_y = torch.einsum("Zijk,aip,pjq,qkr,rls,smt,tnu->Zlmn", x, *cores)
    return want_y, torch.autograd.grad(want_y, (x, *cores), dy, retain_graph=True)


def test_thin_transposed_gemm_is_run_transposed_with_exact_gradients():
    f, x, cores, plan = _layer((16, 8, 8), (8, 8, 4), 6, 1024, seed=0)
    source = generate(plan, [tuple(t.shape) for t in (x, *cores)], torch.float64, "cpu").source
    assert ".mT.contiguous()" in source  # the weight gradient x^T dz (1024 x 6) runs as dz^T x
    dy = torch.randn(1024, 8, 8, 4, dtype=torch.float64)
    got = torch.autograd.grad(f(x, *cores), (x, *cores), dy)
    _, want = _einsum_grads(x, cores, dy)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_every_gemm_run_transposed_gives_exact_values_and_gradients():
    """Autotune may mark any GEMM ``transposed`` (run as (B^T A^T)^T): batched or not, forward
    or backward, real or complex, the values and gradients stay torch.einsum's."""
    from dataclasses import replace

    from tncomp.compiler.ops import MatMul, transpose_gemms

    torch.manual_seed(1)
    cases = [("Zij,aip,pjq,qkr,rls->Zkl", tncomp.tt_linear((3, 4), (4, 3), 2), torch.float64),
             ("bij,bjk->bik", tncomp.from_eq("bij,bjk->bik", (3, 4, 5), (3, 5, 2)),
              torch.complex128)]
    for eq, net, dtype in cases:
        shapes = [tuple(s if isinstance(s, int) else 5 for s in net.shape(t))
                  for t in net.operands]
        ops = [torch.randn(*s, dtype=dtype, requires_grad=True) for s in shapes]
        f = tncomp.compile(net, disk_cache=False)
        plan = f.plan_of(*ops)
        fwd = [k for k, op in enumerate(plan.forward) if isinstance(op, MatMul)]
        bwd = [k for k, op in enumerate(plan.backward) if isinstance(op, MatMul)]
        flipped = replace(plan, forward=transpose_gemms(plan.forward, fwd),
                          backward=transpose_gemms(plan.backward, bwd))
        assert all(flipped.forward[k].transposed for k in fwd) and fwd and bwd
        code = generate(flipped, shapes, dtype, "cpu")
        assert code.source.count(".mT.contiguous()") == len(fwd) + len(bwd)
        y, saved = code.forward(*[o.detach() for o in ops])
        dy = torch.randn(y.shape, dtype=dtype)
        grads = code.backward([o.detach() for o in ops], saved, dy)
        torch.testing.assert_close(y, torch.einsum(eq, *ops).detach(), rtol=1e-10, atol=1e-10)
        plain = generate(plan, shapes, dtype, "cpu")  # its gradients are checked elsewhere
        want = plain.backward([o.detach() for o in ops], plain.forward(*ops)[1], dy)
        for g, w in zip(grads, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
        if not dtype.is_complex:
            want = torch.autograd.grad(torch.einsum(eq, *ops), ops, dy)
            for g, w in zip(grads, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_thin_rule_covers_rank_30_gemms_and_leaves_aligned_wide_ones():
    """Issue 14: thin GEMMs with 30 output columns (rank 30) ran 1.3-1.8x faster transposed on
    CPU; 16 columns with 4096 rows (A B) ran faster direct."""
    from tncomp.compiler.ops import MatMul, MatView
    from tncomp.runtime.codegen import thin_transposed

    cpu = torch.device("cpu")

    def gemm(m, k, n, ta=False):
        lhs = MatView(0, (k, m) if ta else (m, k), ta)
        return MatMul(2, lhs, MatView(1, (k, n), False), 2 * m * k * n, 0)

    assert thin_transposed(gemm(4096, 768, 30), cpu)  # x L (forward, rank 30)
    assert thin_transposed(gemm(768, 4096, 30, ta=True), cpu)  # x^T dT (weight gradient)
    assert thin_transposed(gemm(128, 768, 16), cpu)  # few rows: any thin width
    assert not thin_transposed(gemm(4096, 768, 16), cpu)  # aligned width, many rows
    assert not thin_transposed(gemm(4096, 768, 64), cpu)  # not thin
    assert not thin_transposed(gemm(4096, 64, 30), cpu)  # short inner size
    assert not thin_transposed(gemm(4096, 768, 30), torch.device("meta"))


def test_pooled_transposed_gemms_give_exact_values_and_gradients():
    f, x, cores, plan = _layer((8, 8, 4), (4, 8, 8), 30, 2048, seed=2)
    source = generate(plan, [tuple(t.shape) for t in (x, *cores)], torch.float64, "cpu").source
    assert ".take().copy_(torch.mm(" in source  # x L (2048 x 30) into pooled buffers
    dy = torch.randn(2048, 4, 8, 8, dtype=torch.float64)
    for _ in range(2):  # the second call reuses the pooled buffers
        got = torch.autograd.grad(f(x, *cores), (x, *cores), dy)
    want_y, want = _einsum_grads(x, cores, dy)
    torch.testing.assert_close(f(x, *cores), want_y, rtol=1e-10, atol=1e-10)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_backward_reads_a_large_dy_once_for_both_gemms_with_exact_gradients():
    """Issue 14: dT = dY R^T and dR = T^T dY read dY twice; the fused form (fused_rows) reads
    it in row blocks once. Only pooling (in-place) code fuses; the plain code does not."""
    f, x, cores, plan = _layer((8, 8, 4), (8, 8, 12), 30, 1024, seed=3)  # dY: 6 MB
    shapes = [tuple(t.shape) for t in (x, *cores)]
    code = generate(plan, shapes, torch.float64, "cpu")
    assert code.fused == 1 and "_fused_rows(" in code.source
    assert generate(plan, shapes, torch.float64, "cpu", pool=False).fused == 0
    dy = torch.randn(1024, 8, 8, 12, dtype=torch.float64)
    got = torch.autograd.grad(f(x, *cores), (x, *cores), dy)
    want_y, want = _einsum_grads(x, cores, dy)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    # create_graph runs the plain code (no in-place steps): second derivatives still work
    y = f(x, *cores)
    (gx,) = torch.autograd.grad((y * dy).sum(), x, create_graph=True)
    (ggx,) = torch.autograd.grad(gx.square().sum(), cores[0])
    (wgx,) = torch.autograd.grad((want_y * dy).sum(), x, create_graph=True)
    torch.testing.assert_close(ggx, torch.autograd.grad(wgx.square().sum(), cores[0])[0],
                               rtol=1e-9, atol=1e-9)


def test_narrow_batched_gemms_put_their_narrow_side_as_rows():
    """Issue 40: a BTT layer's batched GEMMs (64 blocks of (2048 x 16) @ (16 x 8), and the
    weight gradients' (16 x 2048) @ (2048 x 8)) run with the 8-wide side as rows; a 16-wide
    side of a large result stays columns."""
    from tncomp.compiler.ops import MatMul, MatView
    from tncomp.runtime.codegen import narrow_batch_side, runs_transposed

    cpu = torch.device("cpu")

    def bmm(m, k, n, batch=64, transposed=False):
        return MatMul(2, MatView(0, (batch, m, k), False), MatView(1, (batch, k, n), False),
                      2 * batch * m * k * n, 0, transposed=transposed)

    assert narrow_batch_side(bmm(2048, 16, 8), cpu) is True  # 8 columns: flip
    assert narrow_batch_side(bmm(16, 2048, 8), cpu) is True  # weight gradient, 16 x 8
    assert narrow_batch_side(bmm(8, 2048, 16), cpu) is False  # already 8 x 16: keep
    assert not runs_transposed(bmm(8, 2048, 16), cpu)  # over the reduction rule's flip
    assert narrow_batch_side(bmm(16, 2048, 16), cpu) is None  # square: the other rules
    # 16 columns run about as fast as 16 rows: flipping (2048 x 16) results only adds the thin
    # copy back (2.5x the direct GEMM's time at d_model 128); a result narrow both ways flips
    assert narrow_batch_side(bmm(2048, 16, 16, batch=8), cpu) is False
    assert narrow_batch_side(bmm(64, 2048, 16, batch=8), cpu) is False
    assert narrow_batch_side(bmm(16, 2048, 12), cpu) is True
    assert narrow_batch_side(bmm(2048, 16, 64), cpu) is None  # no narrow side
    assert narrow_batch_side(bmm(2048, 16, 8, batch=1), cpu) is None  # a plain GEMM
    assert narrow_batch_side(bmm(2048, 16, 8), torch.device("meta")) is None
    assert runs_transposed(bmm(8, 2048, 16, transposed=True), cpu)  # autotune's mark wins


def test_btt_plans_with_flipped_batched_gemms_give_einsums_values_and_gradients():
    from tests.helpers.tn import bind, operands, reference
    from tests.tncomp.compiler.test_layouts import btt

    net = btt((4, 2, 4), (4, 4, 2), rank=2)
    compiled = tncomp.compile(net, disk_cache=False)
    ts = operands(net, 300, requires_grad=True)
    plan = compiled.plan_for(bind(net, 300), (True,) * 4, dtype=torch.float64)
    from tncomp.compiler.ops import MatMul
    from tncomp.runtime.codegen import narrow_batch_side

    assert any(isinstance(op, MatMul) and narrow_batch_side(op, torch.device("cpu"))
               for op in (*plan.forward, *plan.backward))  # the rule is exercised
    y = compiled(*ts)
    want = reference(net, ts)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(y)
    for got, expected in zip(torch.autograd.grad(y, ts, dy),
                             torch.autograd.grad(want, ts, dy), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_small_unblocked_permutes_are_inline_copies_with_einsums_values_and_gradients():
    """A BTT layer's small permute copies (below the pooled size, not run as 2-D transposes)
    are one inline ``permute().contiguous()`` in the fast code (no helper call and no empty
    buffer per copy: at d_model 128 that call overhead is part of each layer's fixed cost);
    the large ones still go through the pooled helper. Values and gradients stay
    torch.einsum's (float64)."""
    from tncomp.compiler.ops import Permute, blocked
    from tncomp.runtime.buffers import MIN_POOLED_BYTES

    torch.manual_seed(3)
    eq = "bijk,ijkpa,ajkpqr,rkpqs->bpqs"  # a d=3 BTT: core k trades i_k for o_k
    shapes = [(64, 4, 4, 8), (4, 4, 8, 4, 2), (2, 4, 8, 4, 4, 2), (2, 8, 4, 4, 8)]
    net = tncomp.from_eq(eq, *shapes)
    ops = [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in shapes]
    f = tncomp.compile(net, disk_cache=False)
    plan = f.plan_of(*ops)
    code = generate(plan, shapes, torch.float64, "cpu")
    permutes = [op for op in (*plan.forward, *plan.backward) if isinstance(op, Permute)]
    small = [op for op in permutes
             if math.prod(op.shape) * 8 < MIN_POOLED_BYTES and not blocked(op.swap)]
    assert small
    for op in small:
        assert f"v{op.dst} = _permute_into(" not in code.source
        assert f"v{op.dst} = " in code.source and ".contiguous()" in code.source
    assert code.source.count("_permute_into(") == len(permutes) - len(small)
    dy = torch.randn(plan.output_shape, dtype=torch.float64)
    got = torch.autograd.grad(f(*ops), ops, dy)
    want = torch.autograd.grad(torch.einsum(eq, *ops), ops, dy)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
