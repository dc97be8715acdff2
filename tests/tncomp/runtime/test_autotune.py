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
