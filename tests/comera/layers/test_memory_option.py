"""The memory option on TT layers, conversion and training: same results, fewer saved bytes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import comera
from comera.cli import _engine_config, build_parser
from comera.errors import ConfigError
from comera.experiments.engine import EngineConfig
from comera.experiments.registry import experiment
from tests.helpers.saved import saved_by_autograd


def test_min_layer_matches_fast_and_saves_less():
    torch.manual_seed(0)
    fast = comera.TTLinear(64, 64, (4, 4, 4), (4, 4, 4), 16, dtype=torch.float64)
    low = comera.TTLinear(64, 64, (4, 4, 4), (4, 4, 4), 16, dtype=torch.float64, memory="min")
    low.load_state_dict(fast.state_dict())
    assert low.memory == "min" and low.compiled().options.memory == "min"
    x = torch.randn(16, 64, dtype=torch.float64)
    y_fast, kept_fast = saved_by_autograd(fast, x)
    y_low, kept_low = saved_by_autograd(low, x)
    torch.testing.assert_close(y_low, y_fast, rtol=1e-12, atol=1e-12)
    assert kept_low < kept_fast
    g_fast = torch.autograd.grad(y_fast.square().sum(), list(fast.cores))
    g_low = torch.autograd.grad(y_low.square().sum(), list(low.cores))
    torch.testing.assert_close(g_low, g_fast, rtol=1e-12, atol=1e-12)


def test_setting_memory_replans_and_fast_keeps_the_old_options():
    layer = comera.TTLinear(16, 16, (4, 4), (4, 4), 2)
    assert layer.memory == "fast" and layer.compile_options == {}
    layer.memory = "balanced"
    assert layer.compiled().options.memory == "balanced"
    layer.memory = "fast"
    assert layer.compile_options == {} and layer.compiled().options.memory == "fast"


@pytest.mark.parametrize("bad", ["low", None, -5, 2.0])
def test_a_bad_memory_is_a_config_error_naming_it(bad):
    with pytest.raises(ConfigError, match="memory=") as info:
        comera.TTLinear(16, 16, (4, 4), (4, 4), 2, memory=bad)
    assert repr(bad) in str(info.value) and "'min'" in str(info.value)
    with pytest.raises(ConfigError, match="memory="):
        comera.convert_(nn.Sequential(nn.Linear(16, 16)), memory=bad)
    with pytest.raises(ConfigError, match="memory="):
        EngineConfig(memory=bad)


def test_convert_sets_memory_on_every_tt_layer():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    comera.convert_(model, ranks=4, memory="min")
    layers = [m for _, m in comera.gated_layers(model)]
    assert len(layers) == 2 and all(m.memory == "min" for m in layers)


def test_train_flag_reaches_the_engine_config():
    args = build_parser().parse_args(["train", "dlrm", "--quick", "--memory", "min"])
    assert _engine_config(args, experiment("dlrm")).memory == "min"
    args = build_parser().parse_args(["train", "dlrm", "--quick"])
    assert _engine_config(args, experiment("dlrm")).memory == "fast"


def test_training_in_min_matches_fast_and_resumes_across_modes(tmp_path):
    from comera.experiments.engine import train_model
    from tests.helpers.toy_task import ToyTask

    cfg = EngineConfig(steps_early=4, steps_late=0, batch_size=16, lr=1e-2, eval_every=2,
                       stage="early")
    fast, _ = train_model(ToyTask(), "comera", cfg, tmp_path / "fast")
    low, _ = train_model(ToyTask(), "comera", replace(cfg, memory="min"), tmp_path / "min")
    assert all(m.memory == "min" for _, m in comera.gated_layers(low))
    for a, b in zip(fast.state_dict().values(), low.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # the mode leaves results unchanged, so a run may resume under another one
    train_model(ToyTask(), "comera", cfg, tmp_path / "mixed", stop_after=2)
    mixed, _ = train_model(ToyTask(), "comera", replace(cfg, memory="balanced"),
                           tmp_path / "mixed", resume=True)
    assert all(m.memory == "balanced" for _, m in comera.gated_layers(mixed))
