"""Operands with an empty axis (a data loader's empty last batch): torch.einsum's result."""

from __future__ import annotations

import pytest
import torch

import tncomp
from tests.helpers.tn import compile_net, operands, reference
from tncomp.errors import SizeError

NETS = {
    "tt": lambda: tncomp.tt_linear([2, 3], [3, 2], 2),
    "batch_summed": lambda: tncomp.from_eq("bi,ij->j", ("B", 3), (3, 2)),
    "embedding": lambda: tncomp.ttm_embedding([2, 3], [3, 2], 2),
}


@pytest.mark.parametrize("name", sorted(NETS))
@pytest.mark.parametrize("grad", [False, True])
def test_batch_zero_matches_einsum(name, grad):
    net = NETS[name]()
    f = compile_net(net)
    ts = operands(net, 0, seed=1, requires_grad=grad)
    refs = [t.detach().clone().requires_grad_(grad) for t in ts]
    y, want = f(*ts), reference(net, refs)
    assert y.shape == want.shape and y.dtype == want.dtype
    torch.testing.assert_close(y, want)
    if grad:
        got = torch.autograd.grad(y.sum(), ts, allow_unused=True)
        ref = torch.autograd.grad(want.sum(), refs, allow_unused=True)
        for g, r, t in zip(got, ref, ts, strict=True):
            g = torch.zeros_like(t) if g is None else g
            r = torch.zeros_like(t) if r is None else r
            torch.testing.assert_close(g, r)


def test_batch_zero_then_nonzero_reuses_nothing_wrong():
    net = NETS["tt"]()
    f = compile_net(net)
    empty = operands(net, 0, seed=2)
    full = operands(net, 3, seed=2)
    assert f(*empty).shape == (0, 3, 2)
    torch.testing.assert_close(f(*full), reference(net, full))


def test_empty_operands_still_checked():
    net = NETS["tt"]()
    f = compile_net(net)
    x, *cores = operands(net, 0, seed=3)
    with pytest.raises(SizeError, match="core"):
        f(x, *(c[..., :1] if k == 0 else c for k, c in enumerate(cores)))
