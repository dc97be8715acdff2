"""Parameter accounting: num_parameters, model_size, dense_size, compression_ratio.

The numbers of the paper's MNLI configuration are computed by hand below.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import comera
from comera import TTEmbedding, TTLinear, TTMLinear
from comera.ranks.size import dense_size

# Q/K/V/O: TTLinear(768, 768, in_modes=(12, 8, 8), out_modes=(8, 8, 12), ranks=30)
#   modes 12, 8, 8, 8, 8, 12; interior bond k = min(30, prod(modes[:k]), prod(modes[k:]))
#   -> bonds (1, 12, 30, 30, 30, 12, 1)
#   cores: 1*12*12 + 12*8*30 + 30*8*30 + 30*8*30 + 30*8*12 + 12*12*1
#        = 144 + 2880 + 7200 + 7200 + 2880 + 144 = 20,448
ATTN_BONDS, ATTN_PARAMS = (1, 12, 30, 30, 30, 12, 1), 20_448
# FFN-in: TTLinear(768, 3072, (12, 8, 8), (12, 16, 16), 30): modes 12, 8, 8, 12, 16, 16
#   -> bonds (1, 12, 30, 30, 30, 16, 1)
#   cores: 144 + 12*8*30 + 30*8*30 + 30*12*30 + 30*16*16 + 16*16*1
#        = 144 + 2880 + 7200 + 10800 + 7680 + 256 = 28,960
FFN_IN_BONDS, FFN_PARAMS = (1, 12, 30, 30, 30, 16, 1), 28_960
# FFN-out: TTLinear(3072, 768, (16, 16, 12), (8, 8, 12), 30): modes 16, 16, 12, 8, 8, 12
#   -> bonds (1, 16, 30, 30, 30, 12, 1)
#   cores: 16*16 + 16*16*30 + 30*12*30 + 30*8*30 + 30*8*12 + 12*12
#        = 256 + 7680 + 10800 + 7200 + 2880 + 144 = 28,960
FFN_OUT_BONDS = (1, 16, 30, 30, 30, 12, 1)
# six blocks of 4 attention + 2 FFN layers: 6 * (4 * 20,448 + 2 * 28,960) = 6 * 139,712
BLOCKS_TT = 838_272
# plus a 768 x 768 pooler in the attention format: 838,272 + 20,448
WITH_POOLER_TT = 858_720
# dense: 6 * (4 * 768*768 + 2 * 768*3072) = 6 * (2,359,296 + 4,718,592) = 42,467,328
BLOCKS_DENSE = 6 * (4 * 768 * 768 + 2 * 768 * 3072)
WITH_POOLER_DENSE = BLOCKS_DENSE + 768 * 768  # 43,057,152
# TTEmbedding(30522, 768, row_modes=(16, 20, 10, 10), col_modes=(4, 4, 8, 6), ranks=32):
#   slices m*n: 64, 80, 80, 60 -> bonds (1, 32, 32, 32, 1)
#   cores: 1*64*32 + 32*80*32 + 32*80*32 + 32*60*1 = 2048 + 81920 + 81920 + 1920 = 167,808
EMB_BONDS, EMB_PARAMS = (1, 32, 32, 32, 1), 167_808


def _attn():
    return TTLinear(768, 768, (12, 8, 8), (8, 8, 12), ranks=30, bias=False)


def _ffn_in():
    return TTLinear(768, 3072, (12, 8, 8), (12, 16, 16), ranks=30, bias=False)


def _ffn_out():
    return TTLinear(3072, 768, (16, 16, 12), (8, 8, 12), ranks=30, bias=False)


def _embedding():
    return TTEmbedding(30522, 768, row_modes=(16, 20, 10, 10), col_modes=(4, 4, 8, 6),
                       ranks=32)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = _attn(), _attn(), _attn(), _attn()
        self.ffn_in, self.ffn_out = _ffn_in(), _ffn_out()


class Encoder(nn.Module):
    def __init__(self, pooler: bool = False, embedding: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(6)])
        self.pooler = _attn() if pooler else None
        self.embedding = _embedding() if embedding else None


@pytest.mark.parametrize(("make", "bonds", "params"), [
    (_attn, ATTN_BONDS, ATTN_PARAMS),
    (_ffn_in, FFN_IN_BONDS, FFN_PARAMS),
    (_ffn_out, FFN_OUT_BONDS, FFN_PARAMS),
    (_embedding, EMB_BONDS, EMB_PARAMS),
])
def test_mnli_layer_counts(make, bonds, params):
    layer = make()
    assert layer.bonds == bonds
    assert layer.ranks == bonds  # all gates are 1 at initialisation
    assert layer.num_parameters(effective=True) == params
    stored = params + sum(bonds[1:-1])  # effective=False also counts the gates
    assert layer.num_parameters(effective=False) == stored


def test_mnli_blocks_model_size_and_ratio():
    torch.manual_seed(0)
    model = Encoder()
    assert comera.model_size(model) == BLOCKS_TT == 838_272
    assert comera.model_size(model, only=TTLinear) == BLOCKS_TT
    assert dense_size(model) == BLOCKS_DENSE == 42_467_328
    ratio = comera.compression_ratio(model)
    assert ratio == pytest.approx(42_467_328 / 838_272)
    assert ratio == pytest.approx(50.66, abs=0.01)


def test_mnli_with_pooler_and_embedding():
    torch.manual_seed(0)
    model = Encoder(pooler=True, embedding=True)
    model.norm = nn.LayerNorm(768)  # a non-TT parameter block: 2 * 768
    other = 2 * 768
    assert comera.model_size(model, only=TTLinear) == WITH_POOLER_TT == 858_720
    assert comera.model_size(model, only=TTEmbedding) == EMB_PARAMS
    assert comera.model_size(model) == WITH_POOLER_TT + EMB_PARAMS + other
    assert dense_size(model, only=TTLinear) == WITH_POOLER_DENSE == 43_057_152
    assert dense_size(model, only=TTEmbedding) == 30522 * 768
    assert dense_size(model) == WITH_POOLER_DENSE + 30522 * 768 + other
    assert comera.compression_ratio(model, only=TTLinear) == pytest.approx(50.14, abs=0.01)
    assert comera.compression_ratio(model) == pytest.approx(
        (WITH_POOLER_DENSE + 30522 * 768 + other) / (WITH_POOLER_TT + EMB_PARAMS + other))
    assert len(list(comera.gated_layers(model))) == 6 * 6 + 2


def test_effective_size_follows_gates():
    layer = _attn()
    with torch.no_grad():  # prune 10 of the 30 slices of the middle bond (bond 3)
        layer.gates[2][:10] = 0.001
    assert layer.ranks == (1, 12, 30, 20, 30, 12, 1)
    # cores 3 and 4 (30*8*30 each) become 30*8*20 and 20*8*30: 2 * 8 * 30 * 10 = 4,800 fewer
    assert layer.num_parameters(effective=True) == ATTN_PARAMS - 4_800
    assert layer.num_parameters(effective=False) == ATTN_PARAMS + 12 + 30 + 30 + 30 + 12


def test_ttm_counts_m_times_n_per_slice():
    # TTMLinear(12, 30, in (2, 3, 2), out (2, 5, 3), ranks (1, 3, 2, 1)):
    #   cores (1, 2, 2, 3), (3, 3, 5, 2), (2, 2, 3, 1):
    #   1*2*2*3 + 3*3*5*2 + 2*2*3*1 = 12 + 90 + 12 = 114, bias 30
    layer = TTMLinear(12, 30, (2, 3, 2), (2, 5, 3), ranks=[1, 3, 2, 1])
    assert layer.bonds == (1, 3, 2, 1)
    assert layer.num_parameters(effective=True) == 114 + 30
    assert layer.num_parameters(effective=False) == 114 + 30 + 3 + 2
    assert layer.dense_num_parameters() == 12 * 30 + 30
    with torch.no_grad():
        layer.gates[0][2] = 0.0
    # ranks (1, 2, 2, 1): 1*4*2 + 2*15*2 + 2*6*1 = 8 + 60 + 12 = 80
    assert layer.num_parameters(effective=True) == 80 + 30
    model = nn.Sequential(layer)
    assert comera.model_size(model) == 110
    assert dense_size(model) == 390
    assert comera.compression_ratio(model) == pytest.approx(390 / 110)


@pytest.mark.parametrize("cls", [TTLinear, TTMLinear])
def test_all_zero_gate_counts_as_removed(cls):
    layer = cls(12, 10, (3, 4), (2, 5), ranks=2, bias=True)
    keep = cls(12, 10, (3, 4), (2, 5), ranks=2, bias=False)
    model = nn.Sequential(layer, nn.ReLU(), nn.Linear(10, 3))
    model.append(keep)
    full = comera.model_size(model)
    with torch.no_grad():
        layer.gates[-1].zero_()
    assert layer.is_removed()
    assert layer.num_parameters(effective=True) == 10  # the bias only
    assert comera.model_size(model) == 10 + (10 * 3 + 3) + keep.num_parameters()
    assert comera.model_size(model) < full
    assert dense_size(model) == (12 * 10 + 10) + 33 + 120
    # a gate below tau everywhere counts as removed too
    with torch.no_grad():
        layer.gates[-1].fill_(0.5 * layer.tau)
    assert layer.num_parameters(effective=True) == 10


def test_removed_layer_without_bias_counts_zero():
    layer = TTLinear(12, 10, (3, 4), (2, 5), ranks=2, bias=False)
    with torch.no_grad():
        layer.gates[0].zero_()
    assert layer.num_parameters(effective=True) == 0
    assert comera.model_size(nn.Sequential(layer)) == 0
    assert comera.compression_ratio(nn.Sequential(layer)) == 120.0  # guarded by max(size, 1)


def _cached_model():
    """A TT linear layer, a TT token table with a hot-row cache, a pruned rank and a dense head."""
    from comera.layers.cached_embedding import CachedTTEmbedding

    torch.manual_seed(0)
    table = CachedTTEmbedding(TTEmbedding(60, 8, (4, 15), (2, 4), ranks=3), cache_rows=5)
    model = nn.ModuleDict({"emb": table,
                           "proj": TTLinear(8, 12, (2, 4), (3, 4), ranks=3),
                           "head": nn.Linear(12, 2)})
    with torch.no_grad():
        model["proj"].gates[0][0] = 0.0
    return model


def test_checkpoint_report_and_run_summary_count_the_same_size(tmp_path):
    """One count everywhere: the report, the run summary, model_size and compression_ratio
    (on main the report left the hot-row cache outside the TT layers, the summary inside)."""
    from comera.experiments.engine import sizes_of
    from comera.surgery.report import checkpoint_report

    model = _cached_model()
    path = tmp_path / "tt.pt"
    comera.save_checkpoint(path, model)
    report = checkpoint_report(path)
    summary = sizes_of(model)
    tt_size = comera.model_size(model, only=comera.GatedLayer)
    assert report.tt_params == summary["tt_params"] == tt_size
    assert report.tt_dense_params == summary["tt_dense_params"]
    assert report.compression == pytest.approx(summary["tt_compression"])
    assert report.tt_params + report.other_params == comera.model_size(model)
    assert report.cache_params == 5 * 8
    whole = dense_size(model) / comera.model_size(model)
    assert whole == pytest.approx(comera.compression_ratio(model))
    text = str(report)
    assert f"{tt_size:,}" in text and f"{report.compression:.1f}x" in text
    assert f"{whole:.1f}x" in text and "hot-row caches: 40 parameters" in text


def test_report_on_a_dense_checkpoint_says_it_has_no_tt_layers(tmp_path):
    from comera.surgery.report import checkpoint_report

    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    path = tmp_path / "dense.pt"
    comera.save_checkpoint(path, model)
    report = checkpoint_report(path)
    text = str(report)
    assert "no TT layers" in text and "0.0x" not in text and f"{46:,} parameters" in text
    assert report.compression == 1.0
