"""The ColaLinear record (CoLA's B act(A x): no format, so a kind of its own): a truncated
model saved and loaded computes what it did, and a record edited out of range is refused."""

from __future__ import annotations

import pytest
import torch

from comera.models.causal_lm import CausalLM, CausalLMConfig
from comera.ranks.truncate import truncate_
from comera.surgery.checkpoint import load_checkpoint, save_checkpoint
from comera.surgery.records import COLA_KEYS, layer_spec, record_problem

CFG = CausalLMConfig(vocab_size=64, d_model=32, n_heads=2, d_ff=64, n_layers=1, max_len=16,
                     linear="cola", rank=8)


def test_a_truncated_cola_model_round_trips(tmp_path):
    torch.manual_seed(0)
    model = CausalLM(CFG)
    with torch.no_grad():
        model.blocks[0].attn.q.gates[0][:3] = 0.0
    truncate_(model)
    spec = layer_spec(model.blocks[0].attn.q)
    assert set(spec) == {"kind", *COLA_KEYS} and spec["rank"] == 5 and record_problem(spec) is None
    save_checkpoint(tmp_path / "c.pt", model)
    torch.manual_seed(1)
    loaded = CausalLM(CFG)
    load_checkpoint(tmp_path / "c.pt", loaded)
    ids = torch.randint(0, 64, (2, 16))
    assert loaded.blocks[0].attn.q.rank == 5
    assert loaded.blocks[0].attn.q.core_scale_values == model.blocks[0].attn.q.core_scale_values
    assert torch.equal(loaded(ids), model(ids))


@pytest.mark.parametrize(("key", "value", "says"), [
    ("rank", 0, "rank=0"), ("rank", 2.5, "rank=2.5"), ("activation", "tanh", "activation='tanh'"),
    ("bias", "yes", "bias='yes'"), ("in_features", True, "in_features=True")])
def test_an_edited_cola_record_is_refused(key, value, says):
    torch.manual_seed(0)
    spec = layer_spec(CausalLM(CFG).blocks[0].ffn_in) | {key: value}
    assert says in record_problem(spec)
    assert "lacks rank" in record_problem({k: v for k, v in spec.items() if k != "rank"})
