"""Model surgery (comera.surgery.swap): swap submodules by name, rebuild TT layers from records."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import comera
from comera.errors import ConfigError
from comera.surgery.records import build_layer, layer_spec
from comera.surgery.swap import swap_submodule


def test_swap_submodule_by_dotted_name():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)))
    new = nn.Linear(4, 2)
    old = swap_submodule(model, "1.1", new)
    assert isinstance(old, nn.Linear) and old is not new
    assert model[1][1] is new
    with pytest.raises(AttributeError):
        swap_submodule(model, "1.9.x", new)
    with pytest.raises(ConfigError, match="the empty name"):
        swap_submodule(model, "", new)


def test_build_layer_reproduces_the_recorded_layer():
    torch.manual_seed(0)
    layer = comera.TTMLinear(12, 8, (3, 2, 2), (2, 2, 2), ranks=3, tau=0.25,
                             dtype=torch.float64)
    rebuilt = build_layer(layer_spec(layer), layer.cores[0])
    rebuilt.load_state_dict(layer.state_dict())
    assert type(rebuilt) is type(layer) and rebuilt.bonds == layer.bonds and rebuilt.tau == 0.25
    x = torch.randn(5, 12, dtype=torch.float64)
    torch.testing.assert_close(rebuilt(x), layer(x), rtol=0, atol=0)


def test_a_mismatch_of_many_layers_names_each_reason_once(tmp_path):
    """Issue 42, item 9: a model of many blocks repeated the same reason for every layer (1,600
    characters for a GPT-2); the layers sharing a reason are listed once with it."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(16, 16) for _ in range(12)])

    saved = model()
    comera.convert_(saved, ranks=2)
    comera.save_checkpoint(tmp_path / "tt.pt", saved)
    other = model()
    comera.convert_(other, ranks=2, format="tucker")
    with pytest.raises(comera.CheckpointError) as info:
        comera.load_checkpoint(tmp_path / "tt.pt", other)
    text = str(info.value)
    assert "0, 1, 2 and 9 more: the model's layer has format tucker" in text
    assert text.count("format tucker") == 1 and len(text) < 300
    assert all(m.format.name == "tucker" for _, m in comera.gated_layers(other))
