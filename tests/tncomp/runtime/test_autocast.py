"""Mixed precision: compiled networks follow ``torch.autocast`` as ``nn.Linear`` does.

Inside autocast the operands are cast to the autocast dtype and the plan is bound at that dtype;
parameters and their gradients keep their own dtype; results match float32 to within the low
precision. Outside autocast, mixed dtypes are refused with a :class:`DtypeError`.
"""

from __future__ import annotations

import pytest
import torch

import tncomp
from tests.helpers.tn import compile_net, operands, reference
from tncomp.errors import DtypeError, SizeError

LOW = {torch.bfloat16: 2e-2, torch.float16: 3e-3}  # relative error (norm) vs float32


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture
def tt():
    net = tncomp.tt_linear([4, 6], [6, 4], 3)
    ts = operands(net, 16, seed=0, dtype=torch.float32, requires_grad=True)
    return net, compile_net(net), ts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_runs_low_precision_and_keeps_parameter_dtype(dtype, tt, one_thread):
    net, f, ts = tt
    refs = [t.detach().clone().requires_grad_() for t in ts]
    with torch.autocast("cpu", dtype=dtype):
        y = f(*ts)
    assert y.dtype == dtype
    assert any(k[0][1] == dtype for k in f._local), "the plan is bound at the compute dtype"
    want = reference(net, refs)
    assert _rel(y, want) < LOW[dtype]
    gen = torch.Generator().manual_seed(1)
    dy = torch.randn(want.shape, generator=gen)
    y.backward(dy.to(dtype))
    want.backward(dy)
    for t, r in zip(ts, refs, strict=True):
        assert t.grad.dtype == torch.float32
        assert _rel(t.grad, r.grad) < 2 * LOW[dtype]


def test_autocast_leaves_float64_alone(one_thread):
    net = tncomp.from_eq("bi,ij->bj", ("B", 3), (3, 2))
    f = compile_net(net)
    ts = operands(net, 4, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = f(*ts)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, reference(net, ts))


def test_explicit_low_precision_inputs(tt, one_thread):
    net, f, ts = tt
    low = [t.detach().to(torch.bfloat16) for t in ts]
    y = f(*low)
    assert y.dtype == torch.bfloat16
    assert _rel(y, reference(net, [t.detach() for t in ts])) < LOW[torch.bfloat16]


def test_mixed_dtypes_outside_autocast_raise_dtype_error(tt):
    _net, f, ts = tt
    mixed = [ts[0].detach().to(torch.bfloat16), *(t.detach() for t in ts[1:])]
    with pytest.raises(DtypeError, match="autocast") as info:
        f(*mixed)
    assert isinstance(info.value, TypeError) and isinstance(info.value, SizeError)
    with pytest.raises(DtypeError, match="no bool matrices"):  # (integers contract exactly)
        f(*(t.detach().bool() for t in ts))


def test_tt_linear_layer_trains_under_autocast(one_thread):
    """The issue's failure: TTLinear's backward under bf16 autocast ('expected m1 and m2 to
    have the same dtype'). Gradients now reach the float32 cores and match float32."""
    from comera.layers.linear import TTLinear

    torch.manual_seed(0)
    layer = TTLinear(48, 32, ranks=4)
    x = torch.randn(8, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = layer(x).float().pow(2).mean()
    loss.backward()
    low = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    layer(x).pow(2).mean().backward()
    for g, p in zip(low, layer.parameters(), strict=True):
        assert g.dtype == p.dtype == torch.float32
        assert _rel(g, p.grad) < 5e-2


@pytest.mark.slow
def test_project_transformer_with_tt_embedding_trains_under_bf16_autocast(one_thread):
    """The issue's table row: the project's transformer (TT layers and a TT embedding) runs
    forward and backward under bf16 autocast, close to float32, with float32 gradients."""
    from comera.models.transformer import PairClassifier, TransformerConfig

    torch.manual_seed(0)
    cfg = TransformerConfig.small(vocab_size=100, dropout=0.0,
                                  embedding_modes=((5, 5, 4), (8, 8, 4)))
    model = PairClassifier(cfg)
    ids = torch.randint(1, 100, (4, 16))
    want = model(ids).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(ids)
    got.float().sum().backward()
    assert got.dtype == torch.bfloat16 and _rel(got, want) < 5e-2
    params = list(model.parameters())
    assert all(p.grad is not None and p.grad.dtype == p.dtype == torch.float32 for p in params)
