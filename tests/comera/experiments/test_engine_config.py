"""Every EngineConfig field refuses bad values with a typed ConfigError naming the field, and
the settings a task must meet are checked before any training (issue 26, item 4)."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

import comera
from comera.experiments.engine import EngineConfig, check_task, train_model
from comera.experiments.results import run_experiment
from tests.helpers.toy_task import ToyTask

HUGE = 10**30
# bad values by a field's type; a field may add its own (0 where 0 is invalid)
BY_TYPE = {
    "int": [-1, HUGE, 1.5, "3", None, True, math.nan],
    "float": [math.nan, math.inf, -math.inf, -1.0, "0.1", None, True],
    "float | None": [math.nan, math.inf, -1.0, 0.0, "0.1", True],
    "str": ["", "bogus", None, 3],
    "bool": [1, "yes", None],
}
EXTRA = {"batch_size": [0], "eval_every": [0], "lr": [0.0], "lr_gates": [0.0],
         "target_compression": [0.0, 1.0], "max_grad_norm": [0.0], "seed": [2**63],
         "threads": [10**6], "device": ["tpu:0 x"], "format": ["einsum", "nope"],
         "early_target": [1.0, 0.5], "early_landing": [0.0, 1.5]}
FINE = {"late_target_loss": [0.0]}  # values of a type's bad list that a field takes


def _cases():
    hints = typing.get_type_hints(EngineConfig)
    cases = []
    for field in dataclasses.fields(EngineConfig):
        kind = str(hints[field.name]).replace("<class '", "").replace("'>", "")
        kind = kind.replace("typing.Optional[float]", "float | None")
        assert kind in BY_TYPE, f"EngineConfig.{field.name}: list bad values for {kind}"
        for value in BY_TYPE[kind] + EXTRA.get(field.name, []):
            if any(value is fine or value == fine for fine in FINE.get(field.name, [])):
                continue
            cases.append(pytest.param(field.name, value, id=f"{field.name}={value!r}"))
    return cases


@pytest.mark.parametrize("name, value", _cases())
def test_every_field_refuses_bad_values_with_a_config_error_naming_it(name, value):
    if name == "device":  # parsed when the run starts: check_settings, still before any work
        from comera.experiments.engine import check_settings

        with pytest.raises(comera.ConfigError, match="device"):
            check_settings(EngineConfig(device=value))
        return
    with pytest.raises(comera.ConfigError, match=name):
        EngineConfig(**{name: value})


def test_the_defaults_and_none_where_allowed_pass():
    EngineConfig()
    EngineConfig(lr_other=None, max_grad_norm=None, lam=0.0, seed=2**63 - 1, threads=0)


class _CountingTask(ToyTask):
    def batch(self, indices):
        raise AssertionError("a batch was served: training started")


def test_an_unreachable_target_compression_is_refused_before_training(tmp_path):
    task = _CountingTask()
    config = EngineConfig(steps_early=4, steps_late=4, batch_size=16, target_compression=1e308)
    with pytest.raises(comera.ConfigError, match=r"target_compression=1e\+308 cannot be "
                                                 r"reached.*choose target_compression <= "):
        run_experiment(task, config, tmp_path / "out")
    with pytest.raises(comera.ConfigError, match="cannot be reached"):
        train_model(task, "comera", config, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    check_task(task, dataclasses.replace(config, target_compression=2.0))  # reachable
    check_task(task, dataclasses.replace(config, format="dense"))  # dense: no target


def test_a_batch_larger_than_the_training_split_is_refused(tmp_path):
    config = EngineConfig(steps_early=4, steps_late=0, batch_size=257)
    with pytest.raises(comera.ConfigError, match="batch_size=257 exceeds the 256"):
        run_experiment(_CountingTask(), config, tmp_path / "out")
    assert not (tmp_path / "out").exists()
