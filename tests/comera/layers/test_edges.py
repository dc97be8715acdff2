"""The edges a user reaches first (issue 26, item 6): id dtypes, non-finite gates, empty
batches, 0-dim and meta inputs, and factorising non-finite weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import comera
from comera.formats.ttsvd import tt_svd
from comera.layers.cached_embedding import CachedTTEmbedding
from comera.ranks.truncate import round_, truncate_


def _linear(cls=comera.TTLinear):
    torch.manual_seed(0)
    return cls(16, 16, (4, 4), (4, 4), 3, dtype=torch.float64)


# -- id dtypes --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int8, torch.float32,
                                   torch.bool])
def test_embeddings_refuse_the_id_dtypes_nn_embedding_refuses_at_the_door(dtype):
    ids = torch.tensor([1, 2, 0]).to(dtype)
    with pytest.raises(RuntimeError):  # what nn.Embedding does
        nn.Embedding(64, 8)(ids)
    table = comera.TTEmbedding(64, 8, ranks=3)
    for layer in (table, CachedTTEmbedding(table, 4)):
        with pytest.raises(comera.ConfigError, match=rf"got {dtype}: pass ids.long\(\)"):
            layer(ids)


def test_embeddings_take_int32_and_int64_ids_alike():
    table = comera.TTEmbedding(64, 8, ranks=3)
    ids = torch.tensor([[1, 63], [0, 7]])
    for layer in (table, CachedTTEmbedding(table, 4)):
        assert torch.equal(layer(ids.int()), layer(ids))


# -- non-finite gates -------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_gate_is_an_error_in_truncation_never_silently_pruned(bad):
    model = nn.Sequential(_linear(), nn.Tanh(), _linear(comera.TTMLinear))
    with torch.no_grad():
        model[2].gates[0][1] = bad
    assert model[2].ranks[1] == 3  # counted alive: it reaches the output (was pruned)
    bonds = [m.bonds for _, m in comera.gated_layers(model)]
    for cut in (truncate_, round_):
        with pytest.raises(comera.NonFiniteError, match=r"layer 2: gate 0 .* at \[1\]"):
            cut(model)
    assert [m.bonds for _, m in comera.gated_layers(model)] == bonds  # nothing changed


# -- empty batches, 0-dim and meta inputs -----------------------------------------------------
@pytest.mark.parametrize("cls", [comera.TTLinear, comera.TTMLinear])
def test_an_empty_batch_gives_zero_gradients_like_nn_linear(cls):
    layer, dense = _linear(cls), nn.Linear(16, 16, dtype=torch.float64)
    x = torch.randn(0, 16, dtype=torch.float64)
    layer(x).sum().backward()
    dense(x).sum().backward()
    assert dense.weight.grad is not None and not dense.weight.grad.any()
    for p in layer.parameters():
        assert p.grad is not None and p.grad.shape == p.shape and not p.grad.any()


def test_a_0_dim_input_is_a_clear_error():
    with pytest.raises(comera.ConfigError, match=r"0-dim tensor.*reshape"):
        _linear()(torch.tensor(1.0, dtype=torch.float64))


@pytest.mark.parametrize("autocast", [False, True])
def test_meta_inputs_give_meta_outputs_or_a_clear_error(autocast):
    meta = comera.TTLinear(16, 16, (4, 4), (4, 4), 3, device="meta")
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.no_grad()
    with context:
        y = meta(torch.randn(2, 5, 16, device="meta"))
        assert y.device.type == "meta" and y.shape == (2, 5, 16)
        with pytest.raises(comera.ConfigError, match="input is on meta, the cores on cpu"):
            _linear()(torch.randn(2, 16, device="meta"))
        table = comera.TTEmbedding(64, 8, ranks=3, device="meta")
        rows = table(torch.zeros(2, 3, dtype=torch.long, device="meta"))
        assert rows.device.type == "meta" and rows.shape == (2, 3, 8)
        with pytest.raises(comera.ConfigError, match="ids are on meta, the cores on cpu"):
            comera.TTEmbedding(64, 8, ranks=3)(torch.zeros(2, dtype=torch.long, device="meta"))


# -- factorising non-finite weights -----------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_factorising_non_finite_weights_is_a_clear_error(bad):
    linear, table = nn.Linear(16, 16), nn.Embedding(64, 8)
    with torch.no_grad():
        linear.weight[3, 2] = bad
        table.weight[5, 1] = bad
    with pytest.raises(comera.ConversionError, match="1 NaN or infinite weight entries"):
        comera.TTLinear.from_linear(linear, 4, (4, 4), (4, 4))
    with pytest.raises(comera.ConversionError, match=r"Embedding\(64, 8\) has 1 NaN"):
        comera.TTEmbedding.from_embedding(table, 4)
    with pytest.raises(comera.ConversionError, match="NaN or infinite"):
        comera.convert_(nn.Sequential(linear), ranks=4)
    with pytest.raises(comera.ConfigError, match="1 NaN or infinite entries"):
        tt_svd(linear.weight.detach().reshape(4, 4, 4, 4), 4)
