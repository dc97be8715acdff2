"""A run's optimizer and schedule: the warm-up then constant or cosine factor, the named groups
or plain AdamW, as the engine applies them step by step."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
import torch

import comera
from comera.experiments.engine import EngineConfig, train_model
from comera.experiments.optim_schedule import lr_factor, run_optimizer
from tests.helpers.toy_task import ToyTask

CFG = EngineConfig(steps_early=6, steps_late=0, batch_size=16, lr=1e-2, lr_gates=0.1, lam=0.0,
                   eval_every=2, threads=1)


def test_warm_up_then_constant_or_cosine():
    assert [lr_factor(s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(0, 0) == 1.0
    cosine = [lr_factor(s, 2, 10, "cosine") for s in range(10)]
    assert cosine[:2] == [0.5, 1.0] and cosine[2] == 1.0
    assert cosine[6] == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 8)))
    assert all(a >= b for a, b in itertools.pairwise(cosine[2:]))
    assert lr_factor(10, 2, 10, "cosine") == pytest.approx(0.0)


def test_the_named_groups_or_plain_adamw():
    model = ToyTask().build_model("tt")
    groups = run_optimizer(model, CFG)
    assert {g["name"] for g in groups.param_groups} == {"cores", "gates", "other"}
    assert all(g["weight_decay"] == 0.0 for g in groups.param_groups)
    plain = run_optimizer(model, replace(CFG, optimizer="adamw"))
    assert type(plain) is torch.optim.AdamW and len(plain.param_groups) == 1
    assert plain.param_groups[0]["weight_decay"] == 0.01  # torch's default, as a user gets it
    assert len(plain.param_groups[0]["params"]) == len(list(model.parameters()))


def test_the_engine_steps_the_schedule(tmp_path, monkeypatch):
    seen = []
    original = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        seen.append(self.param_groups[0]["lr"])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    cfg = replace(CFG, optimizer="adamw", schedule="cosine", warmup=2, steps_early=8,
                  format="dense")
    train_model(ToyTask(), "dense", cfg, tmp_path)
    assert seen == pytest.approx([1e-2 * lr_factor(s, 2, 8, "cosine") for s in range(8)])


def test_a_given_model_from_a_later_step_and_the_clock(tmp_path):
    """The engine trains a given model from a given step; every evaluation point has its
    training wall-clock."""
    cfg = replace(CFG, steps_early=8, format="dense")
    _, record = train_model(ToyTask(), "dense", cfg, tmp_path / "whole")
    assert len(record.val_seconds) == len(record.val_curve)
    assert record.val_seconds == sorted(record.val_seconds) and record.train_seconds > 0
    assert record.val_seconds[-1] == pytest.approx(record.train_seconds)
    first, _ = train_model(ToyTask(), "dense", replace(cfg, steps_early=4, seed=0),
                           tmp_path / "first")
    # the first run's model goes on from step 4 (a fresh optimizer: no state carries over)
    given = ToyTask().build_model("dense")
    given.load_state_dict(first.state_dict())
    later, rec = train_model(ToyTask(), "dense", cfg, tmp_path / "later",
                             build=lambda: given, start_step=4)
    assert later is given and rec.val_curve[0][0] == 4 and rec.steps == 8
    with pytest.raises(comera.ConfigError, match="start_step=8"):
        train_model(ToyTask(), "dense", cfg, tmp_path / "x", start_step=8)
    with pytest.raises(comera.ConfigError, match="late_target_loss"):
        train_model(ToyTask(), "comera", replace(cfg, steps_late=4, target_compression=3.0,
                                                 format="tt"),
                    tmp_path / "y", start_step=8)
    with pytest.raises(comera.ConfigError, match="no gated layers"):
        train_model(ToyTask(), "comera", replace(cfg, format="tt"), tmp_path / "z",
                    build=lambda: torch.nn.Linear(2, 2))
    with pytest.raises(comera.ConfigError, match="build=3"):
        train_model(ToyTask(), "comera", cfg, tmp_path / "z", build=3)
