"""comera's layers in the stacks people train with: torch.autocast and torch.compile.

Under autocast a TT linear layer computes in the autocast dtype and a TT embedding returns its
table's dtype, exactly as nn.Linear and nn.Embedding do; parameters and their gradients keep
their own dtype. Under torch.compile the layers' own code traces without graph breaks (no
data-dependent Python such as ``int(ids.min())`` or ``unique``); the contraction itself is
tncomp's compiled network (one opaque op with tncomp's custom-op runtime)."""

import pytest
import torch
from torch import nn

import comera

BF16 = dict(rtol=2e-2, atol=2e-2)  # bfloat16 keeps 8 bits of mantissa


def _model():
    torch.manual_seed(0)
    return nn.Sequential(comera.TTEmbedding(60, 16, ranks=4, padding_idx=3),
                         comera.TTLinear(16, 24, ranks=4), nn.ReLU(),
                         comera.TTLinear(24, 8, ranks=4))


def _ids():
    return torch.tensor([[1, 3, 59, 7, 1], [0, 22, 3, 41, 58]])


def test_linear_follows_autocast_like_nn_linear():
    torch.manual_seed(0)
    tt = comera.TTLinear(16, 24, ranks=4)
    dense = nn.Linear(16, 24)
    x = torch.randn(5, 16)
    want = tt(x)
    want.square().sum().backward()
    want_grads = [c.grad.clone() for c in tt.cores]
    tt.zero_grad()
    with torch.autocast("cpu", torch.bfloat16):
        got = tt(x)
        assert got.dtype == dense(x).dtype == torch.bfloat16
    got.float().square().sum().backward()
    torch.testing.assert_close(got.float(), want, **BF16)
    for core, grad in zip(tt.cores, want_grads, strict=True):
        assert core.dtype == core.grad.dtype == torch.float32
        torch.testing.assert_close(core.grad, grad, rtol=5e-2, atol=5e-2 * grad.abs().max())


def test_embedding_follows_autocast_like_nn_embedding():
    emb = _model()[0]
    ids = _ids()
    want = emb(ids)
    with torch.autocast("cpu", torch.bfloat16):
        got = emb(ids)
        assert got.dtype == nn.Embedding(4, 2)(torch.tensor([1])).dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the table's rows, unrounded
    got.sum().backward()
    assert all(c.grad is not None and c.grad.dtype == torch.float32 for c in emb.cores)


def test_a_model_trains_under_autocast_and_in_bfloat16():
    model = _model()
    ids = _ids()
    want = model(ids)
    with torch.autocast("cpu", torch.bfloat16):
        got = model(ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, **BF16)
    got.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == p.dtype == torch.float32
               for p in model.parameters())
    low = _model().to(torch.bfloat16)  # an explicitly converted model keeps working
    out = low(ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, **BF16)
    out.sum().backward()
    assert all(p.grad.dtype == torch.bfloat16 for p in low.parameters())


def test_fresh_and_truncated_models_trace_without_graph_breaks():
    """A model traced before any eager call, and again after truncation, gives 0 graph breaks:
    layers build their compiled networks when their shapes change, never inside the trace
    (regression: building one there broke the graph, and the re-trace made core sizes symbolic
    and crashed the custom op's fake implementation)."""
    model = _model()
    ids = _ids()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    with torch.no_grad():
        model[1].gates[1][:2] = 0.0  # prune two ranks of a bond, then remove them physically
    comera.truncate_(model)
    assert model[1].bonds[2] == 2
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch.testing.assert_close(torch.compile(model, backend="eager", fullgraph=True)(ids),
                               model(ids))


def test_out_of_range_ids_still_raise():
    emb = _model()[0]
    with pytest.raises(comera.LookupIndexError, match="60"):
        emb(torch.tensor([0, 60]))
    with pytest.raises(comera.LookupIndexError, match="-1"):
        emb(torch.tensor([-1, 2]))


def test_compile_fullgraph_matches_eager():
    """Needs tncomp's compiled networks as one custom op (the runtime's torch.compile work)."""
    model = _model()
    ids = _ids()
    want = model(ids)
    want.square().sum().backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got = compiled(ids)
    got.square().sum().backward()
    torch.testing.assert_close(got, want)
    for p, grad in zip(model.parameters(), want_grads, strict=True):
        torch.testing.assert_close(p.grad, grad)
    with pytest.raises(RuntimeError, match="out of range"):
        compiled(torch.tensor([[0, 60, 1, 2, 3], [0, 1, 2, 3, 4]]))


def test_compiled_training_over_changing_batch_sizes_equals_eager():
    """A compiled model called with a new batch size (an uneven last batch) recompiles with a
    dynamic size; it trains and equals eager (regression: the saving operator's fake
    implementation crashed on the symbolic size, `unhashable type: non-nested SymInt`)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    comera.convert_(model, comera.ConvertConfig(ranks=4))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for batch in (8, 5, 3):
        x = torch.randn(batch, 16)
        model.zero_grad()
        model(x).square().sum().backward()
        want = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        got = compiled(x)
        got.square().sum().backward()
        torch.testing.assert_close(got, model(x))
        for p, grad in zip(model.parameters(), want, strict=True):
            torch.testing.assert_close(p.grad, grad)
