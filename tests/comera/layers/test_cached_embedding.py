"""TT-Rec's hot-row cache: exact lookups of cached rows, gradients to both parts, sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import comera
from comera.layers.cached_embedding import CachedTTEmbedding
from comera.models.dlrm import DLRM, DLRMConfig
from comera.ranks.size import dense_size

F64 = torch.float64


def _table(cache_rows: int = 4) -> CachedTTEmbedding:
    torch.manual_seed(0)
    tt = comera.TTEmbedding(60, 8, (3, 4, 5), (2, 2, 2), ranks=3, dtype=F64)
    return CachedTTEmbedding(tt, cache_rows)


def test_wrapping_keeps_the_function_and_cached_rows_are_looked_up_exactly():
    layer = _table()
    ids = torch.arange(60)
    torch.testing.assert_close(layer(ids), layer.tt(ids))  # the cache starts at the TT rows
    counts = torch.zeros(60)
    counts[[7, 31, 59, 2, 40]] = torch.tensor([9.0, 50.0, 3.0, 9.0, 1.0])
    hot = layer.choose_hot_ids_(counts)
    assert hot.tolist() == [2, 7, 31, 59]  # top 4; the tie 2 / 7 both fit, 40 (1) does not
    with torch.no_grad():
        layer.cache.copy_(torch.randn(4, 8, dtype=F64))
    out = layer(torch.tensor([[31, 5], [2, 59]]))
    assert torch.equal(out[0, 0], layer.cache[2]) and torch.equal(out[1, 0], layer.cache[0])
    assert torch.equal(out[1, 1], layer.cache[3])
    torch.testing.assert_close(out[0, 1], layer.tt(torch.tensor([5]))[0])
    assert layer.hit_rate(torch.tensor([31, 5, 2, 59])) == 0.75


def test_the_cache_costs_memory_in_its_rows_not_in_the_table_rows():
    """No (V,) id -> row map: on a 10M-row table that alone was 81 MiB, more than the TT
    cores; the buffers hold the C hot ids only, and int32 ids find them too."""
    tt = comera.TTEmbedding(1_000_000, 8, (100, 100, 100), (2, 2, 2), ranks=4)
    layer = CachedTTEmbedding(tt, 16)
    assert sum(b.numel() for b in layer.buffers()) == 16
    hot = layer.choose_hot_ids_(torch.zeros(1_000_000).index_fill_(0, torch.arange(5, 21), 1.0))
    assert hot.tolist() == list(range(5, 21))
    ids = torch.tensor([4, 5, 20, 21, 999_999], dtype=torch.int32)
    assert layer.slots(ids).tolist() == [-1, 0, 15, -1, -1]
    torch.testing.assert_close(layer(ids)[1], layer.cache[0])


def test_state_dicts_with_the_old_row_map_still_load():
    layer = _table()
    layer.choose_hot_ids_(torch.arange(60, 0, -1).float())
    state = {**layer.state_dict(), "slot": torch.full((60,), -1)}  # as saved before
    fresh = _table()
    fresh.load_state_dict(state)
    assert torch.equal(fresh.hot_ids, layer.hot_ids)
    torch.testing.assert_close(fresh(torch.arange(60)), layer(torch.arange(60)))


def test_gradients_reach_the_cache_rows_used_and_the_cores():
    layer = _table()
    layer.choose_hot_ids_(torch.tensor([0.0, 0, 5, 0, 4, 3, 2]))  # hot: 2, 4, 5, 6
    ids = torch.tensor([2, 2, 6, 10, 33])
    weights = torch.randn(5, 8, dtype=F64)
    (layer(ids) * weights).sum().backward()
    expected = torch.zeros(4, 8, dtype=F64)
    expected[0] = weights[0] + weights[1]  # id 2 twice
    expected[3] = weights[2]  # id 6
    torch.testing.assert_close(layer.cache.grad, expected)
    assert all(c.grad is not None and c.grad.abs().sum() > 0 for c in layer.tt.cores)
    # only cached ids: no gradient reaches the TT cores
    layer.zero_grad(set_to_none=True)
    layer(torch.tensor([4, 5])).sum().backward()
    assert all(c.grad is None or not c.grad.any() for c in layer.tt.cores)


def test_cached_rows_count_in_the_model_size_once():
    layer = _table(cache_rows=5)
    model = nn.Sequential(layer, nn.Linear(8, 2, dtype=F64))
    tt_params = layer.tt.num_parameters()
    assert comera.model_size(model) == tt_params + 5 * 8 + 8 * 2 + 2
    assert dense_size(model) == 60 * 8 + 8 * 2 + 2  # the cached rows are table rows
    assert comera.model_size(model, only=comera.TTEmbedding) == tt_params + 40
    assert comera.compression_ratio(model, only=comera.TTEmbedding) == pytest.approx(
        480 / (tt_params + 40))
    assert layer.num_parameters() == tt_params + 40 and layer.dense_num_parameters() == 480


def test_dlrm_caches_the_most_frequent_training_ids():
    cfg = DLRMConfig(cardinalities=(50, 2000), embedding_dim=4, bottom_mlp=(8, 4),
                     top_mlp=(8, 1), table_format="ttm", tt_ranks=4, tt_min_rows=1000,
                     tt_cache_rows=16)
    model = DLRM(cfg)
    table = model.embeddings[1]
    assert isinstance(table, CachedTTEmbedding) and isinstance(model.embeddings[0],
                                                               nn.Embedding)
    sparse = torch.stack([torch.zeros(400, dtype=torch.long),
                          torch.cat([torch.arange(100, 116).repeat(20), torch.arange(80)])], 1)
    assert model.choose_hot_rows_(sparse) == [80]  # 320 of 400 lookups
    assert table.hot_ids.tolist() == list(range(100, 116))
    assert model.table_parameters() == 50 * 4 + table.tt.num_parameters() + 16 * 4
    logits = model(torch.randn(400, 13), sparse)
    assert logits.shape == (400,) and torch.isfinite(logits).all()


def test_bad_cache_sizes_are_refused():
    tt = comera.TTEmbedding(60, 8, (3, 4, 5), (2, 2, 2), ranks=3)
    with pytest.raises(comera.ConfigError, match="cache_rows=61"):
        CachedTTEmbedding(tt, 61)
    with pytest.raises(comera.ConfigError, match="wraps a TTEmbedding"):
        CachedTTEmbedding(nn.Embedding(4, 2), 1)
    with pytest.raises(comera.ConfigError, match="tt_cache_rows"):
        DLRMConfig(tt_cache_rows=-1)
