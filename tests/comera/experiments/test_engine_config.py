"""Every EngineConfig field refuses bad values with a typed ConfigError naming the field, and
the settings a task must meet are checked before any training (issue 26, item 4). The settings
come in groups that check their own fields and hand each consumer its part (issue 43)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import typing

import pytest
import torch

import comera
from comera.experiments.engine import EngineConfig, check_task, train_model
from comera.experiments.engine_config import (
    GROUPS,
    RESULT_FREE,
    LateSettings,
    OptimSettings,
    RankSettings,
    RunSettings,
    RuntimeSettings,
)
from comera.experiments.optim_schedule import lr_factor
from comera.experiments.results import run_experiment
from comera.training.early import EarlyStage
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


# -- the groups (issue 43) -------------------------------------------------------------------------
def test_the_groups_partition_the_settings_and_their_names_take_none():
    names = [f.name for kind in GROUPS.values() for f in dataclasses.fields(kind)]
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(EngineConfig))
    assert len(names) == len(set(names)) == 33
    # config.late, config.optim, ... and the groups' methods shadow no setting: EngineConfig has
    # them all (a method named like a field of another group would hide it on the class)
    members = {name for kind in GROUPS.values() for name in vars(kind) if not name.startswith("_")
               and name not in {f.name for f in dataclasses.fields(kind)}}
    assert not (set(GROUPS) | members) & set(names)
    assert {"late_stage", "early_stage", "loss_target", "total_steps"} <= members
    assert all(issubclass(EngineConfig, kind) for kind in GROUPS.values())
    config = EngineConfig()
    for name, kind in GROUPS.items():  # each group's default is EngineConfig's
        assert type(getattr(config, name)) is kind and getattr(config, name) == kind()


@pytest.mark.parametrize("name, value", _cases())
def test_each_group_refuses_its_bad_values_with_the_config_s_message(name, value):
    """A group checks its fields alone, word for word as the whole config does."""
    kind = next(k for k in GROUPS.values() if name in {f.name for f in dataclasses.fields(k)})
    try:
        EngineConfig(**{name: value})
    except comera.ConfigError as exc:
        with pytest.raises(comera.ConfigError) as alone:
            kind(**{name: value})
        assert str(alone.value) == str(exc)
    else:  # a device this machine cannot parse: refused when the run starts
        kind(**{name: value})


def test_a_config_of_groups_is_the_flat_one_and_hands_out_each_group():
    optim = OptimSettings(lr=3e-4, steps_early=20, steps_late=10)
    late = LateSettings(target_compression=20.0, late_landing=0.5)
    config = EngineConfig.from_groups(optim=optim, late=late)
    assert config == EngineConfig(lr=3e-4, steps_early=20, steps_late=10,
                                  target_compression=20.0, late_landing=0.5)
    assert config.optim == optim and config.late == late and config.total_steps == 30
    assert config.ranks == RankSettings() and config.run == RunSettings()
    assert config.runtime == RuntimeSettings()
    changed = dataclasses.replace(config, lr=1e-2, late_landing=0.25)  # flat, as before
    assert changed.optim == dataclasses.replace(optim, lr=1e-2) and changed.lr == 1e-2
    assert changed.late.late_landing == 0.25
    assert dataclasses.replace(config, **dataclasses.asdict(LateSettings())).late == LateSettings()
    assert EngineConfig.from_groups() == EngineConfig()
    with pytest.raises(comera.ConfigError, match=r"from_groups\(late=OptimSettings.*give a "
                                                 r"LateSettings"):
        EngineConfig.from_groups(late=OptimSettings())
    with pytest.raises(TypeError):
        EngineConfig.from_groups(optim)  # groups by name: late=..., optim=...


def test_a_check_across_groups_stays_with_the_config():
    LateSettings(late_allocation="spectrum")  # alone: no format to refuse
    RunSettings(format="tucker")
    with pytest.raises(comera.ConfigError, match=r"late_allocation='spectrum' with "
                                                 r"format='tucker'"):
        EngineConfig.from_groups(run=RunSettings(format="tucker"),
                                 late=LateSettings(late_allocation="spectrum"))


def test_the_late_settings_give_the_loss_target_and_the_stage():
    late = LateSettings(target_compression=2.0, late_loss_slack=0.1, late_landing=0.5,
                        late_allocation="spectrum")
    assert late.loss_target([1.0, 2.0, 3.0]) == pytest.approx(2.2)
    assert dataclasses.replace(late, late_target_loss=0.0).loss_target([]) == 0.0
    with pytest.raises(comera.ConfigError, match="no early step ran; set steps_early >= 1"):
        late.loss_target([])
    model = ToyTask().build_model("tt")
    assert late.late_stage(model, 0.5, steps=8) == comera.LateStage.for_compression(
        model, 2.0, target_loss=0.5, steps=8, landing=0.5, allocation="spectrum")


def test_the_rank_runtime_and_optim_settings_give_what_the_engine_reads():
    model = ToyTask().build_model("tt")
    assert RankSettings().early_stage(model, 10) is None
    assert RankSettings(early_target=2.0, early_landing=0.25).early_stage(model, 10) == \
        EarlyStage.for_compression(model, 2.0, 10, 0.25)
    cpu = torch.device("cpu")
    assert isinstance(RuntimeSettings().autocast(cpu), contextlib.nullcontext)
    cast = RuntimeSettings(precision="bf16").autocast(cpu)
    assert isinstance(cast, torch.autocast) and cast.fast_dtype == torch.bfloat16
    optim = OptimSettings(warmup=2, schedule="cosine")
    assert [optim.lr_factor(s, 10) for s in range(10)] == [lr_factor(s, 2, 10, "cosine")
                                                          for s in range(10)]
    assert set(RESULT_FREE) == {f.name for f in dataclasses.fields(RuntimeSettings)} - {
        "precision"}


def test_a_resume_may_change_the_runtime_but_not_the_precision(tmp_path):
    config = EngineConfig(steps_early=6, steps_late=4, batch_size=16, lr=1e-2, lam=1.0,
                          target_compression=2.0, eval_every=3, threads=1)
    train_model(ToyTask(), "comera", config, tmp_path, stop_after=3)
    with pytest.raises(comera.CheckpointError, match=r"other settings \(precision"):
        train_model(ToyTask(), "comera", dataclasses.replace(config, precision="bf16"),
                    tmp_path, resume=True)
    _, record = train_model(ToyTask(), "comera",
                            dataclasses.replace(config, memory="min", threads=2), tmp_path,
                            resume=True)
    assert record.steps == config.total_steps


def test_auto_late_allocation_shapes_chains_from_their_spectra_and_prunes_the_rest():
    from torch import nn

    import comera
    from comera.experiments.engine_config import LateSettings

    def model(fmt: str) -> nn.Module:
        return nn.Sequential(comera.GatedLinear(16, 16, format=fmt, ranks=2), nn.Linear(16, 4))

    auto = LateSettings()
    assert auto.late_allocation == "auto"
    assert auto.allocation_for(model("tt")) == "spectrum"
    assert auto.allocation_for(model("ttm")) == "spectrum"
    assert auto.allocation_for(model("btt")) == "prune"  # not a chain
    assert auto.allocation_for(model("cp")) == "prune"  # no exact rounding
    mixed = nn.Sequential(comera.GatedLinear(16, 16, format="tt", ranks=2),
                          comera.GatedLinear(16, 16, format="btt", ranks=2))
    assert auto.allocation_for(mixed) == "prune"  # spectrum needs every layer a chain
    assert auto.allocation_for(nn.Linear(4, 4)) == "prune"  # nothing gated
    plain = nn.Sequential(comera.GatedLinear(16, 16, format="tt", ranks=2,
                                             parametrization="plain"))
    assert auto.allocation_for(plain) == "prune"  # plain cores prune, as the paper does
    for chosen in ("prune", "spectrum"):
        assert LateSettings(late_allocation=chosen).allocation_for(model("btt")) == chosen
    with pytest.raises(comera.ConfigError, match=r"late_allocation='bogus'.*auto"):
        LateSettings(late_allocation="bogus")
