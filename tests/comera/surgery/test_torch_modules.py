"""convert_ on torch's transformer modules: nn.MultiheadAttention, nn.TransformerEncoder(Layer),
nn.TransformerDecoderLayer. At full rank a converted module computes what the original did, in
train and eval mode (torch's eval fast paths read dense weights: they are switched off), and the
gradients reach every TT core."""

import copy

import pytest
import torch
from torch import nn

import comera
from comera.layers.attention import TTMultiheadAttention

FULL = 64  # above every TT-SVD bond bound of these sizes: the conversion is exact
E, H = 16, 2


def _converted(module, **options):
    tt = copy.deepcopy(module)
    report = comera.convert_(tt, ranks=FULL, **options)
    return tt, report


def _cores(module):
    return [c for _, m in comera.gated_layers(module) for c in m.cores]


@pytest.mark.parametrize(("in_proj", "batch_first"), [("split", False), ("packed", True)])
def test_attention_at_full_rank_equals_the_original(in_proj, batch_first):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=batch_first, dtype=torch.float64)
    tt, report = _converted(nn.Sequential(mha), attention_in_proj=in_proj)
    assert isinstance(tt[0], TTMultiheadAttention)
    names = {r.name for r in report.layers}
    assert names == ({"0.in_proj", "0.out_proj"} if in_proj == "packed"
                     else {"0.q_proj", "0.k_proj", "0.v_proj", "0.out_proj"})
    B, L, S = 3, 5, 7
    shape = (lambda n: (B, n, E)) if batch_first else (lambda n: (n, B, E))
    q, k, v = (torch.randn(*shape(n), dtype=torch.float64) for n in (L, S, S))
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[0, -2:] = True
    causal = torch.ones(L, S, dtype=torch.bool).triu(1)
    float_mask = torch.randn(B * H, L, S, dtype=torch.float64)
    for mode in ("train", "eval"):
        mha.train(mode == "train")
        tt.train(mode == "train")
        cases = [dict(query=q, key=k, value=v),
                 dict(query=q, key=k, value=v, key_padding_mask=padding, attn_mask=causal),
                 dict(query=q, key=k, value=v, attn_mask=float_mask, average_attn_weights=False),
                 dict(query=q, key=q, value=q, need_weights=False, key_padding_mask=padding[:, :L]),
                 dict(query=q[0] if batch_first else q[:, 0], key=k[0] if batch_first else k[:, 0],
                      value=v[0] if batch_first else v[:, 0])]  # unbatched
        for kwargs in cases:
            want, want_w = mha(**kwargs)
            got, got_w = tt[0](**kwargs)
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
            if want_w is None:
                assert got_w is None
            else:
                torch.testing.assert_close(got_w, want_w, rtol=1e-9, atol=1e-9)


def test_attention_with_other_key_and_value_sizes():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, kdim=12, vdim=8, batch_first=True, dtype=torch.float64)
    tt, _ = _converted(nn.Sequential(mha))
    q = torch.randn(2, 4, E, dtype=torch.float64)
    k, v = torch.randn(2, 6, 12, dtype=torch.float64), torch.randn(2, 6, 8, dtype=torch.float64)
    torch.testing.assert_close(tt[0](q, k, v)[0], mha(q, k, v)[0], rtol=1e-9, atol=1e-9)
    with pytest.raises(comera.ConversionError, match="packed"):
        comera.convert_(copy.deepcopy(nn.Sequential(mha)), attention_in_proj="packed")


def _encoder(dtype):
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=E, dropout=0.0, batch_first=True,
                                       dtype=dtype)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True)


@pytest.mark.parametrize("dtype", [torch.float64])
def test_encoder_trains_and_evaluates_like_the_original(dtype):
    torch.manual_seed(0)
    enc = _encoder(dtype)
    tt, report = _converted(enc)
    assert len(report.layers) == 2 * 6  # q, k, v, out_proj, linear1, linear2 per layer
    assert not any(isinstance(m, nn.Linear) for m in tt.modules())  # no dense weight left
    x = torch.randn(3, 5, E, dtype=dtype)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[1, -2:] = True
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    # train mode, and eval mode where torch would take its fused fast path (nested tensors for
    # the padded batch: its padded positions come out as zeros, so compare the real ones)
    for mode in (True, False):
        enc.train(mode)
        tt.train(mode)
        with torch.no_grad():
            torch.testing.assert_close(tt(x), enc(x), **tol)
            want, got = enc(x, src_key_padding_mask=padding), tt(x, src_key_padding_mask=padding)
            torch.testing.assert_close(got[~padding], want[~padding], **tol)
    tt.train()
    tt(x, src_key_padding_mask=padding).square().sum().backward()
    cores = _cores(tt)
    assert len(cores) == 12 * 6  # d = 3: six cores per TT layer
    assert all(c.grad is not None and c.grad.abs().sum() > 0 for c in cores)


def test_encoder_layer_eval_fast_path_uses_the_tt_weights():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=E, dropout=0.0, batch_first=True)
    tt, _ = _converted(nn.Sequential(layer))
    tt.eval()
    x = torch.randn(2, 4, E)
    before = tt(x)
    with torch.no_grad():
        tt[0].linear1.cores[0].mul_(2.0)  # the eval path must see a change of the TT weights
    assert not torch.allclose(tt(x), before)
    # only the feed-forward converted: the layer's fast path is off as well
    partial, _ = _converted(nn.Sequential(layer), include=["*linear*"])
    assert isinstance(partial[0].self_attn, nn.MultiheadAttention)
    layer.eval()
    partial.eval()
    torch.testing.assert_close(partial(x), layer(x), rtol=1e-4, atol=1e-5)


def test_decoder_layer_at_full_rank_equals_the_original():
    torch.manual_seed(0)
    dec = nn.TransformerDecoderLayer(E, H, dim_feedforward=E, dropout=0.0, dtype=torch.float64)
    tt, _ = _converted(nn.Sequential(dec))
    assert isinstance(tt[0].multihead_attn, TTMultiheadAttention)
    tgt = torch.randn(4, 2, E, dtype=torch.float64)
    memory = torch.randn(6, 2, E, dtype=torch.float64)
    mask = nn.Transformer.generate_square_subsequent_mask(4, dtype=torch.float64)
    for mode in (True, False):
        dec.train(mode)
        tt.train(mode)
        torch.testing.assert_close(tt[0](tgt, memory, tgt_mask=mask),
                                   dec(tgt, memory, tgt_mask=mask), rtol=1e-9, atol=1e-9)
    tt[0](tgt, memory, tgt_mask=mask).sum().backward()
    assert all(c.grad is not None for c in _cores(tt))


def test_a_tied_layer_is_left_dense_and_reported():
    emb = nn.Embedding(32, E)
    head = nn.Linear(E, 32, bias=False)
    head.weight = emb.weight  # tied, as GPT-2's lm_head and wte
    model = nn.Sequential(emb, nn.Linear(E, E), head)
    report = comera.convert_(model, ranks=4)
    assert report.skipped == ("2",)
    assert isinstance(model[2], nn.Linear) and model[2].weight is model[0].weight
    assert "left dense" in str(report)
    with pytest.raises(comera.ConversionError, match="tied"):
        comera.convert_(nn.Sequential(emb, head), ranks=4)


def test_attention_with_bias_kv_is_refused():
    mha = nn.MultiheadAttention(E, H, add_bias_kv=True)
    with pytest.raises(comera.ConversionError, match="add_bias_kv"):
        comera.convert_(nn.Sequential(mha))


def test_a_checkpoint_loaded_into_a_dense_encoder_layer_runs_in_eval(tmp_path):
    """Loading swaps gated layers into an unconverted nn.TransformerEncoderLayer: its eval fast
    path (which reads linear1.weight) is switched off there too (it raised AttributeError)."""
    def layer():
        torch.manual_seed(0)
        return nn.TransformerEncoderLayer(16, 2, 16, batch_first=True, dropout=0.0).eval()

    model = layer()
    comera.convert_(model, ranks=4, exclude=["self_attn"])
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        y = model(x)
    comera.save_checkpoint(tmp_path / "run.pt", model)
    fresh = layer()
    comera.load_checkpoint(tmp_path / "run.pt", fresh)
    with torch.no_grad():
        assert torch.equal(fresh(x), y)


def test_a_failing_load_leaves_a_dense_encoder_as_it_was(tmp_path):
    """Issue 42, item 1: loading converts a dense attention to a TTMultiheadAttention before
    it checks the rest; a mismatch found then undoes the swap (and the fast-path flags)."""
    def encoder(dim_feedforward):
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward, batch_first=True,
                                           dropout=0.0)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()

    model = encoder(16)
    comera.convert_(model, ranks=4, include=["*self_attn"])
    comera.save_pretrained(model, tmp_path / "tt")
    comera.save_checkpoint(tmp_path / "tt.pt", model)
    other = encoder(24)  # its feed-forward differs: the dense weights do not fit
    before = copy.deepcopy(other)
    flags = [m.activation_relu_or_gelu for m in other.layers]
    for load in (lambda: comera.from_pretrained(tmp_path / "tt", other),
                 lambda: comera.load_checkpoint(tmp_path / "tt.pt", other)):
        with pytest.raises(comera.CheckpointError, match=r"linear1\.weight"):
            load()
        assert all(type(m.self_attn) is nn.MultiheadAttention for m in other.layers)
        assert [m.activation_relu_or_gelu for m in other.layers] == flags
        state, want = other.state_dict(), before.state_dict()
        assert state.keys() == want.keys()
        assert all(torch.equal(state[k], want[k]) for k in state)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert torch.equal(other(x), before(x))
