"""Codegen picks the fast CPU layout of a thin transposed GEMM (A^T B with few output columns
and a long inner size, the weight gradient of a low-rank TT layer), with unchanged values."""

import torch

import tncomp
from tncomp.runtime.codegen import generate


def test_thin_transposed_gemm_is_run_transposed_with_exact_gradients():
    torch.manual_seed(0)
    net = tncomp.tt_linear((16, 8, 8), (8, 8, 4), 6)
    f = tncomp.compile(net, disk_cache=False)
    x = torch.randn(1024, 16, 8, 8, dtype=torch.float64, requires_grad=True)
    cores = [torch.randn(*net.shape(t), dtype=torch.float64, requires_grad=True)
             for t in net.operands[1:]]
    plan = f.plan_of(x, *cores)
    source = generate(plan, [tuple(t.shape) for t in (x, *cores)], torch.float64, "cpu").source
    assert ".mT.contiguous()" in source  # the weight gradient x^T dz (1024 x 6) runs as dz^T x
    dy = torch.randn(1024, 8, 8, 4, dtype=torch.float64)
    got = torch.autograd.grad(f(x, *cores), (x, *cores), dy)
    want_y = torch.einsum("Zijk,aip,pjq,qkr,rls,smt,tnu->Zlmn", x, *cores)
    want = torch.autograd.grad(want_y, (x, *cores), dy)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
