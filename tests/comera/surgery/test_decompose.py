"""convert_ with calibration and a global budget (comera/surgery/decompose.py through
``comera.convert_``): calibrated conversion lowers the model's output error against plain on
skewed inputs and is exact at full rank; the global allocation recovers planted per-layer ranks;
a failing conversion (empty calibration, rejected batches, a budget no allocation can meet, a
format without spectra) leaves the model exactly as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import comera
from comera.errors import ConfigError
from comera.layers.linear import GatedLinear
from comera.surgery.config import ConvertConfig

F64 = torch.float64


def skewed(rows: int, width: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(width, width, generator=gen, dtype=F64))
    return (torch.randn(rows, width, generator=gen, dtype=F64)
            * torch.logspace(0, -3, width, dtype=F64)) @ basis.T


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 32), nn.Tanh(), nn.Linear(32, 24)).to(F64)


def _state(model: nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model: nn.Module, state: dict, types: list) -> None:
    assert [type(m) for m in model.modules()] == types
    after = model.state_dict()
    assert set(after) == set(state)
    assert all(torch.equal(after[k], v) for k, v in state.items())


@pytest.mark.parametrize("fmt", ["tt", "lowrank", "ttm"])
def test_calibrated_conversion_lowers_the_output_error(fmt):
    model = mlp()
    x = skewed(2000, 24, 1)
    y = model(x)
    errors = {}
    for name, calibration in (("plain", None), ("calibrated", list(x.split(500)))):
        converted = copy.deepcopy(model)
        comera.convert_(converted, ConvertConfig(format=fmt, target_compression=2.5),
                        calibration=calibration)
        errors[name] = float((converted(x) - y).norm() / y.norm())
    assert errors["calibrated"] < 0.7 * errors["plain"], errors


@pytest.mark.parametrize("fmt", ["tt", "lowrank", "ttm", "tucker", "tr", "btt"])
def test_full_rank_calibrated_conversion_keeps_the_outputs(fmt):
    model = mlp()
    x = skewed(300, 24, 2)
    converted = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="full rank"):
        report = comera.convert_(converted, ConvertConfig(ranks=10**4, format=fmt),
                                 calibration=[x])
    torch.testing.assert_close(converted(x), model(x), rtol=1e-9, atol=1e-10)
    assert all(r.calibrated and r.error < 1e-9 for r in report.layers)


def _planted(n_in: int, n_out: int, rank: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(n_in, rank, generator=gen, dtype=F64))
    v, _ = torch.linalg.qr(torch.randn(n_out, rank, generator=gen, dtype=F64))
    return (u * torch.linspace(2.0, 1.0, rank, dtype=F64)) @ v.T  # (in, out)


@pytest.mark.parametrize("calibrated", [False, True])
def test_global_allocation_recovers_planted_per_layer_ranks(calibrated):
    shapes, ranks = [(32, 48), (48, 48), (48, 16)], [3, 11, 6]
    model = nn.Sequential(*(nn.Linear(i, o, bias=False) for i, o in shapes)).to(F64)
    with torch.no_grad():
        for k, (layer, (i, o), r) in enumerate(zip(model, shapes, ranks, strict=True)):
            layer.weight.copy_(_planted(i, o, r, k).T)
    budget = sum(r * (i + o) for (i, o), r in zip(shapes, ranks, strict=True))
    calibration = [torch.randn(64, 32, dtype=F64)] if calibrated else None
    report = comera.convert_(model, ConvertConfig(format="lowrank", allocation="global",
                                                  target_size=budget), calibration=calibration)
    assert [r.ranks for r in report.layers] == [(r,) for r in ranks]
    assert report.after == budget
    assert all(r.error < 1e-9 for r in report.layers)  # each planted weight exactly
    assert "one size budget" in str(report)


def test_global_allocation_beats_uniform_where_layers_differ():
    """One layer carries its energy in few directions, the other in many: at the same size,
    the global budget leaves the first at a low rank and the whole model closer to dense."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False)).to(F64)
    with torch.no_grad():
        model[0].weight.copy_(_planted(32, 32, 4, 0).T)
        model[1].weight.copy_(torch.randn(32, 32, dtype=F64) / 6)
    x = torch.randn(256, 32, dtype=F64)
    y = model(x)
    uniform = copy.deepcopy(model)
    report = comera.convert_(uniform, ConvertConfig(format="lowrank", target_compression=2))
    size = report.after
    ranked = copy.deepcopy(model)
    report = comera.convert_(ranked, ConvertConfig(format="lowrank", allocation="global",
                                                   target_size=size))
    assert report.after <= size
    assert report.layers[0].ranks[0] <= 4 < report.layers[1].ranks[0]
    assert (ranked(x) - y).norm() < 0.9 * (uniform(x) - y).norm()


@pytest.mark.parametrize(("options", "calibration", "match"), [
    ({"target_compression": 2}, [], "no batches"),
    ({"target_compression": 2}, [torch.randn(4, 7, dtype=F64)], "rejected it"),
    ({"target_compression": 2}, torch.randn(4, 24, dtype=F64), "one tensor"),
    ({"allocation": "global", "target_size": 5}, None, "cannot be met"),
    ({"allocation": "global", "target_compression": 10**4}, None, "cannot be met"),
    ({"allocation": "global", "target_compression": 2, "format": "tr"}, None, "no"),
    ({"allocation": "global", "target_compression": 2, "format": "cp"}, None, "spectra"),
])
def test_a_failing_conversion_leaves_the_model_unchanged(options, calibration, match):
    model = mlp()
    state, types = _state(model), [type(m) for m in model.modules()]
    with pytest.raises(ConfigError, match=match):
        comera.convert_(model, ConvertConfig(**options), calibration=calibration)
    _unchanged(model, state, types)


def test_global_with_only_embeddings_is_refused():
    model = nn.Sequential(nn.Embedding(64, 16))
    with pytest.raises(ConfigError, match="linear layers"):
        comera.convert_(model, ConvertConfig(linear=False, embedding=True, allocation="global",
                                             target_compression=2))
    assert type(model[0]) is nn.Embedding


def test_report_shows_ranks_and_calibrated_errors():
    model = mlp()
    x = skewed(400, 24, 3)
    report = comera.convert_(model, ConvertConfig(target_compression=2, allocation="global"),
                             calibration=[x[:200], x[200:]])
    text = str(report)
    assert "output err" in text.splitlines()[0]
    assert "2 calibration batch(es)" in text and report.batches == 2
    for layer in report.layers:
        assert layer.calibrated and 0 < layer.error < 1
        assert f"{layer.error:.4f}" in text and str(list(layer.ranks)) in text
    plain = comera.convert_(mlp(), ranks=4)
    assert "weight err" in str(plain).splitlines()[0]
    assert all(0 < r.error < 1 and not r.calibrated for r in plain.layers)


def test_attention_is_calibrated_except_its_out_proj():
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).to(F64)
    x = torch.randn(4, 6, 16, dtype=F64)
    y = model(x)
    report = comera.convert_(model, ConvertConfig(ranks=10**3), calibration=[x])
    calibrated = {r.name: r.calibrated for r in report.layers}
    assert calibrated["self_attn.q_proj"] and calibrated["linear1"] and calibrated["linear2"]
    assert not calibrated["self_attn.out_proj"]
    assert "0.0000*" in str(report)
    torch.testing.assert_close(model(x), y, rtol=1e-8, atol=1e-9)
    assert all(isinstance(m, GatedLinear) for m in (model.linear1, model.linear2))


def test_huggingface_model_takes_dict_batches():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                     n_head=2, n_inner=32, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (4, 12))
    batches = [{"input_ids": ids[:2]}, {"input_ids": ids[2:], "attention_mask": torch.ones(2, 12)}]
    with pytest.warns(UserWarning, match="save_pretrained"):
        report = comera.convert_(model, ConvertConfig(target_compression=2,
                                                      allocation="global"),
                                 calibration=batches)
    assert report.batches == 2 and all(r.calibrated for r in report.layers)
    assert torch.isfinite(model(ids).logits).all()


def test_global_checks_the_attention_out_proj_format_too():
    model = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    state, types = _state(model), [type(m) for m in model.modules()]
    config = ConvertConfig(allocation="global", target_compression=2,
                           format={"self_attn.out_proj": "tr", "*": "tt"})
    with pytest.raises(ConfigError, match=r"self_attn\.out_proj"):
        comera.convert_(model, config)
    _unchanged(model, state, types)
