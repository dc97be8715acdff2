"""Sibling TT layers that read one input run as one stacked contraction: the same outputs and
gradients as the layers one by one (float64, tight), ranks that differ padded exactly, the
attention modules use it for self-attention only, and state_dicts, pickling and torch.compile
see no difference."""

import copy
import pickle

import pytest
import torch
from torch import nn

import comera
import comera.layers.siblings as siblings_module
import tncomp
from comera.layers.attention import TTMultiheadAttention
from comera.layers.siblings import Siblings, stack_key
from comera.models.transformer import SelfAttention, TransformerConfig

F64 = torch.float64
TIGHT = dict(rtol=1e-12, atol=1e-12)


def _layers(kind=comera.TTLinear, ranks=(3, 3, 3), seed=0):
    torch.manual_seed(seed)
    layers = [kind(12, 12, (2, 6), (3, 4), ranks=r, dtype=F64) for r in ranks]
    with torch.no_grad():
        for layer in layers:
            for gate in layer.gates:
                gate.uniform_(0.5, 1.5)
            layer.gates[0][0] = 0.0  # a pruned rank slice: no gradient reaches it
            layer.bias.normal_()
    return layers


@pytest.fixture
def calls(monkeypatch):
    """Every compiled network called, in order (the real call runs)."""
    seen = []
    real = tncomp.CompiledNetwork.__call__

    def spy(self, *operands):
        seen.append(self)
        return real(self, *operands)

    monkeypatch.setattr(tncomp.CompiledNetwork, "__call__", spy)
    return seen


def _check_equal(layers, x):
    """Stacked outputs and gradients (x, cores, gates, bias) equal the layers one by one."""
    params = [p for layer in layers for p in layer.parameters()]
    dys = [torch.randn(*x.shape[:-1], layer.out_features, dtype=F64) for layer in layers]
    want = [layer(x) for layer in layers]
    want_grads = torch.autograd.grad(want, [x, *params], dys)
    siblings = Siblings()
    got = siblings(layers, x)
    got_grads = torch.autograd.grad(got, [x, *params], dys)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TIGHT)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, **TIGHT)
    return siblings


@pytest.mark.parametrize("kind", [comera.TTLinear, comera.TTMLinear])
def test_stacked_outputs_and_gradients_equal_the_layers(kind, calls):
    layers = _layers(kind)
    x = torch.randn(4, 5, 12, dtype=F64, requires_grad=True)
    siblings = _check_equal(layers, x)
    assert siblings.stacked is not None and calls.count(siblings.stacked) == 1
    assert all(layer.gates[0].grad is None for layer in layers)  # grads were taken, not stored


def test_ranks_that_differ_are_padded_exactly(calls):
    layers = _layers(ranks=(4, 3, 2))
    comera.truncate_(nn.ModuleList(layers))  # the pruned slice goes physically
    assert len({layer.bonds for layer in layers}) == 3
    siblings = _check_equal(layers, torch.randn(6, 12, dtype=F64, requires_grad=True))
    assert calls.count(siblings.stacked) == 1


def test_too_much_padding_runs_the_layers_one_by_one(calls, monkeypatch):
    layers = _layers(ranks=(8, 1, 1))  # interior bonds (2, 8, 4), (1, 1, 1) twice: 42 / 20
    assert siblings_module.stack_key(layers) is not None
    monkeypatch.setattr(siblings_module, "MAX_PADDING", 2.0)
    assert siblings_module.stack_key(layers) is None
    siblings = _check_equal(layers, torch.randn(6, 12, dtype=F64, requires_grad=True))
    assert siblings.stacked is None and len(calls) == 6  # three layers, twice


def test_layers_that_differ_do_not_stack():
    a, b = _layers(ranks=(3, 3))
    assert siblings_module.stack_key([a, b]) is not None
    assert siblings_module.stack_key([a]) is None
    assert siblings_module.stack_key([a, comera.TTMLinear(12, 12, (2, 6), (3, 4), ranks=3,
                                                          dtype=F64)]) is None
    assert siblings_module.stack_key([a, comera.TTLinear(12, 12, (6, 2), (3, 4), ranks=3,
                                                         dtype=F64)]) is None
    assert siblings_module.stack_key([a, b.float()]) is None
    assert siblings_module.stack_key([nn.Linear(12, 12), nn.Linear(12, 12)]) is None


def test_bad_and_empty_inputs_behave_as_the_layers():
    layers = _layers()
    siblings = Siblings()
    with pytest.raises(comera.ConfigError, match="12 features"):
        siblings(layers, torch.randn(3, 5, dtype=F64))
    out = siblings(layers, torch.randn(0, 12, dtype=F64))
    assert [tuple(y.shape) for y in out] == [(0, 12)] * 3


def _attention(seed=0):
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(16, 2, batch_first=False, dtype=F64)
    model = nn.Sequential(mha)
    comera.convert_(model, ranks=4)
    assert isinstance(model[0], TTMultiheadAttention) and hasattr(model[0], "q_proj")
    return model[0]


def test_self_attention_projects_in_one_stacked_call(calls):
    attention = _attention()
    x = torch.randn(5, 3, 16, dtype=F64, requires_grad=True)  # (L, B, E): transposed inside
    got = attention(x, x, x)[0]
    assert calls == [attention._siblings.stacked, attention.out_proj.compiled()]
    calls.clear()
    want = attention(x, x.clone(), x.clone())[0]  # other tensors: separate calls
    assert attention._siblings.stacked not in calls and len(calls) == 4
    torch.testing.assert_close(got, want, **TIGHT)
    dy = torch.randn_like(got)
    params = list(attention.parameters())
    for g, w in zip(torch.autograd.grad(got, [x, *params], dy),
                    torch.autograd.grad(want, [x, *params], dy), strict=True):
        torch.testing.assert_close(g, w, **TIGHT)


def test_cross_attention_still_right(calls):
    attention = _attention()
    q, kv = (torch.randn(n, 2, 16, dtype=F64) for n in (4, 6))
    got = attention(q, kv, kv)[0]
    assert attention._siblings.stacked not in calls
    E, H, D = 16, 2, 8
    proj = [p(t.transpose(0, 1)) for p, t in zip(
        (attention.q_proj, attention.k_proj, attention.v_proj), (q, kv, kv), strict=True)]
    qh, kh, vh = (t.reshape(2, -1, H, D).transpose(1, 2) for t in proj)
    att = (qh @ kh.transpose(-2, -1) / D ** 0.5).softmax(-1) @ vh
    want = attention.out_proj(att.transpose(1, 2).reshape(2, 4, E)).transpose(0, 1)
    torch.testing.assert_close(got, want, **TIGHT)


def test_state_dict_pickle_and_deepcopy_round_trip():
    attention = _attention()
    x = torch.randn(5, 3, 16, dtype=F64)
    want = attention(x, x, x)[0]
    state = attention.state_dict()
    assert not any("sibling" in k for k in state)
    assert {k.split(".")[0] for k in state} == {"q_proj", "k_proj", "v_proj", "out_proj"}
    fresh = _attention(seed=1)
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh(x, x, x)[0], want, **TIGHT)
    for clone in (pickle.loads(pickle.dumps(attention)), copy.deepcopy(attention)):
        torch.testing.assert_close(clone(x, x, x)[0], want, **TIGHT)
    old = pickle.loads(pickle.dumps(attention))
    del old.__dict__["_siblings"]  # as pickled before siblings existed
    torch.testing.assert_close(pickle.loads(pickle.dumps(old))(x, x, x)[0], want, **TIGHT)


def _traces_in_one_graph(attention, x):
    def run(t):
        return attention(t, t, t, need_weights=False)[0]

    torch._dynamo.reset()  # fullgraph=True raises at a graph break
    torch.testing.assert_close(torch.compile(run, backend="eager", fullgraph=True)(x), run(x),
                               **TIGHT)


def test_self_attention_traces_in_one_graph():
    _traces_in_one_graph(_attention(), torch.randn(5, 3, 16, dtype=F64))


@pytest.mark.slow
def test_truncated_self_attention_traces_in_one_graph():
    """After truncation the stacked network is stale: a trace runs the layers one by one
    rather than build it inside the graph; eager rebuilds it."""
    attention = _attention()
    with torch.no_grad():
        attention.k_proj.gates[1][:2] = 0.0
    comera.truncate_(attention)
    _traces_in_one_graph(attention, torch.randn(5, 3, 16, dtype=F64))


def test_truncation_rebuilds_the_stacked_network():
    """truncate_ (and round_, through the same truncate.rebuild_stacks) rebuild the stacked
    q/k/v network of the new shapes at once, so a torch.compile trace taken before the next
    eager call still finds it built."""
    attention = _attention()
    layers = (attention.q_proj, attention.k_proj, attention.v_proj)
    with torch.no_grad():
        for layer in layers:  # the padded (largest) bond shrinks: a new stacked network
            layer.gates[1][:2] = 0.0
    before = attention._siblings.stacked
    comera.truncate_(attention)
    assert attention._siblings._compiled_for == stack_key(layers)
    assert attention._siblings.stacked is not before


def test_torch_func_grad_through_self_attention():
    attention = _attention()
    x = torch.randn(5, 3, 16, dtype=F64)
    params = dict(attention.named_parameters())

    def loss(p):
        return torch.func.functional_call(attention, p, (x, x, x))[0].square().sum()

    got = torch.func.grad(loss)(params)
    want = torch.autograd.grad(loss(params), list(params.values()))
    for g, w in zip(got.values(), want, strict=True):
        torch.testing.assert_close(g, w, **TIGHT)


def test_the_transformer_block_stacks_q_k_v(calls):
    cfg = TransformerConfig.small(vocab_size=50, d_model=16, n_heads=2, d_ff=32, rank=3,
                                  attn_modes=((2, 8), (4, 4)), dropout=0.0)
    block = SelfAttention(cfg).double()
    x = torch.randn(2, 5, 16, dtype=F64)
    mask = torch.ones(2, 5, dtype=torch.bool)
    got = block(x, mask)
    assert calls == [block._siblings.stacked, block.o.compiled()]
    b, s, d = x.shape
    q, k, v = (p(x).view(b, s, 2, 8).transpose(1, 2) for p in (block.q, block.k, block.v))
    att = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
    torch.testing.assert_close(got, block.o(att.transpose(1, 2).reshape(b, s, d)), **TIGHT)


def test_packed_self_attention_projects_once_with_the_sequence_axis_first(calls):
    """Regression: the identity test ran after the (L, B, E) transposes made new tensors, so
    self-attention with batch_first=False ran in_proj three times."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.MultiheadAttention(16, 2, dtype=F64))
    comera.convert_(model, ranks=4, attention_in_proj="packed")
    x = torch.randn(5, 3, 16, dtype=F64)
    got = model[0](x, x, x)[0]
    assert calls == [model[0].in_proj.compiled(), model[0].out_proj.compiled()]
    torch.testing.assert_close(got, model[0](x, x.clone(), x.clone())[0], **TIGHT)


def test_stacked_layers_follow_autocast():
    layers = [layer.float() for layer in _layers()]
    x = torch.randn(6, 12)
    with torch.autocast("cpu", torch.bfloat16):
        want = [layer(x) for layer in layers]
        got = Siblings()(layers, x)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)
