"""Grouping EngineConfig (issue 43) changed nothing a run stores or computes: a config pickled by
the flat class of before loads as the same config, a checkpoint that class's engine wrote
resumes, and a run trains to the same bits.

The fixtures (``data/engine_before/``) were written by :mod:`engine_before` with main's code of
fac7af5, before the grouping: a float64 toy run at one thread, every group off its defaults.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
import shutil

import pytest
import torch

from comera.experiments.engine import EngineConfig, train_model
from comera.experiments.engine_config import GROUPS, LateSettings, OptimSettings
from tests.comera.experiments.engine_before import DATA, SETTINGS, STOP
from tests.helpers.toy_task import ToyTask

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def before() -> dict:
    return torch.load(DATA / "run.pt", weights_only=True)


def _assert_the_run_of_before(model, record, before: dict) -> None:
    assert record.train_curve == before["train_curve"]
    assert record.ranks == before["ranks"]
    params = model.state_dict()
    assert params.keys() == before["params"].keys()
    assert all(torch.equal(params[k], before["params"][k]) for k in params)


def test_a_config_pickled_by_the_flat_class_loads_as_the_same_grouped_config():
    saved = json.loads((DATA / "config.json").read_text())
    old = pickle.loads((DATA / "config.pkl").read_bytes())  # our own fixture
    assert type(old) is EngineConfig and old == EngineConfig(**SETTINGS)
    assert dataclasses.asdict(old) == saved  # what checkpoints and summaries store: same keys
    assert old.late == LateSettings(target_compression=3.0, late_loss_slack=0.1,
                                    late_landing=0.6, late_allocation="prune")
    assert old.optim == OptimSettings(**{k: saved[k] for k in (
        f.name for f in dataclasses.fields(OptimSettings))})
    assert EngineConfig.from_groups(**{name: getattr(old, name) for name in GROUPS}) == old


def test_a_checkpoint_of_the_flat_class_resumes_to_the_run_of_before(tmp_path, before, caplog):
    (tmp_path / "checkpoints").mkdir()
    shutil.copy(DATA / "checkpoint.pt", tmp_path / "checkpoints" / "comera.pt")
    config = EngineConfig(**json.loads((DATA / "config.json").read_text()))
    with caplog.at_level(logging.INFO, logger="comera.engine"):
        model, record = train_model(ToyTask(), "comera", config, tmp_path, resume=True)
    assert f"resumed at step {STOP}" in caplog.text
    _assert_the_run_of_before(model, record, before)


def test_a_run_trains_to_the_bits_of_before(tmp_path, before):
    model, record = train_model(ToyTask(), "comera", EngineConfig(**SETTINGS), tmp_path)
    _assert_the_run_of_before(model, record, before)
