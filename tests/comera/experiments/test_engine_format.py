"""The run's layer kind is one word, ``EngineConfig.format`` ("dense" the baseline), from
``train_model`` to the record and the checkpoint; the ``tt`` flag of before still works until
0.3.0, warned, and checkpoints and records written with it still resume and read (issue 43),
as TT, the only format then, though the default is TT-matrix now (issue 40)."""

from __future__ import annotations

import pickle
import warnings
from dataclasses import asdict, replace

import pytest
import torch

import comera
from comera.experiments.checks import check_settings, check_task
from comera.experiments.engine import (
    EngineConfig,
    RunRecord,
    engine_state_format,
    run_checkpoint_format,
    train_model,
)
from comera.experiments.optim_schedule import base_rates, run_optimizer
from comera.experiments.results import run_experiment
from comera.experiments.step_cost import probe_step
from comera.torchfile import read_torch_file
from tests.helpers.checkpoints_before import write_engine_state_as_before_formats
from tests.helpers.toy_task import ToyTask

pytestmark = pytest.mark.usefixtures("one_thread")

# TT, named: the format of the flag's era (the default is TT-matrix now)
CFG = EngineConfig(steps_early=6, steps_late=4, batch_size=16, lr=1e-2, lr_gates=0.1, lam=20.0,
                   target_compression=3.0, eval_every=5, format="tt")
DENSE = replace(CFG, format="dense")
NEW_CALL = r"train_model\(task, name, replace\(config, format='{}'\), out\)"


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_identical(a, b) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_dense_run_is_format_dense(tmp_path):
    """EngineConfig(format="dense") was refused (pointing at tt=False); now it is the dense
    run, recorded and checkpointed under its format."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        model, record = train_model(ToyTask(), "dense", DENSE, tmp_path)
    assert not any(True for _ in comera.gated_layers(model))
    assert record.format == "dense" and list(record.stage_ends) == ["dense"]
    assert record.steps == CFG.total_steps  # as many steps as the CoMERA run
    engine = read_torch_file(tmp_path / "checkpoints" / "dense.pt")["extra"]["engine"]
    assert engine["format"] == "dense" and "tt" not in engine
    assert engine["record"]["format"] == "dense" and "tt" not in engine["record"]
    # a dense run skips what only a CoMERA run needs: a chain format for the spectrum stage
    replace(DENSE, late_allocation="spectrum")
    with pytest.raises(comera.ConfigError, match="late_allocation='spectrum'"):
        replace(CFG, format="tucker", late_allocation="spectrum")


def test_the_comera_variant_of_an_experiment_is_not_dense(tmp_path):
    with pytest.raises(comera.ConfigError, match="format='dense' for the comera variant"):
        run_experiment(ToyTask(), DENSE, tmp_path / "run")
    assert not (tmp_path / "run").exists()


# -- the tt flag of before: each spelling warns and still works -------------------------------
def test_train_model_with_the_flag_in_third_place_warns_and_trains_the_same(tmp_path):
    new, _ = train_model(ToyTask(), "comera", CFG, tmp_path / "new")
    with pytest.warns(DeprecationWarning, match=NEW_CALL.format("tt")):
        old, record = train_model(ToyTask(), "comera", True, CFG, tmp_path / "old")
    _assert_identical(_params(new), _params(old))
    assert record.format == "tt"
    # every argument after out, in the order of before, lands where it did
    with pytest.warns(DeprecationWarning, match=NEW_CALL.format("dense")):
        dense, record = train_model(ToyTask(), "dense", False, CFG, tmp_path / "d", False, None,
                                    3)  # resume, progress, stop_after
    assert record.format == "dense" and len(record.train_curve) == 3  # left after 3 steps
    assert not any(True for _ in comera.gated_layers(dense))


def test_train_model_with_tt_by_name_warns_and_still_works(tmp_path):
    with pytest.warns(DeprecationWarning, match=NEW_CALL.format("dense")):
        model, record = train_model(ToyTask(), "dense", tt=False, config=CFG,
                                    out=tmp_path / "d", stop_after=2)
    assert record.format == "dense" and not any(True for _ in comera.gated_layers(model))
    with pytest.raises(comera.ConfigError, match=r"tt=True beside the kind 'dense'"):
        train_model(ToyTask(), "comera", tt=True, config=DENSE, out=tmp_path / "x")
    with pytest.raises(comera.ConfigError, match="tt given twice"):
        train_model(ToyTask(), "comera", True, CFG, tmp_path / "y", tt=True)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_the_other_engine_functions_read_the_flag_of_before_warned():
    with pytest.warns(DeprecationWarning, match=r"check_settings\(replace\(config, "
                                                r"format='dense'\)\)"):
        check_settings(replace(CFG, steps_early=0), False)  # dense: no early steps needed
    with pytest.warns(DeprecationWarning, match="check_task"):
        check_task(ToyTask(), replace(CFG, target_compression=1e9), False)  # dense: no target
    with pytest.warns(DeprecationWarning, match="base_rates"):
        assert base_rates(CFG, False) == base_rates(DENSE)
    model = ToyTask().build_model("tt")
    with pytest.warns(DeprecationWarning, match="run_optimizer"):
        plain = run_optimizer(model, CFG, tt=False)
    assert [g["name"] for g in plain.param_groups] == ["other"]
    with pytest.warns(DeprecationWarning, match="model_format"):
        assert CFG.model_format(False) == "dense"
    assert CFG.model_format() == "tt"
    batch = ToyTask().batch(torch.arange(8))
    with pytest.warns(DeprecationWarning, match="probe_step"):
        cost = probe_step(model, lambda m: ToyTask().loss(m, batch), CFG, True, batch, steps=1)
    assert cost.ms > 0


def test_a_run_record_of_before_reads_as_its_format():
    with pytest.warns(DeprecationWarning, match=r"RunRecord\(name, format='tt'\)"):
        assert RunRecord("m", True).format == "tt"
    old = {"name": "m", "tt": False, "steps": 3}
    assert RunRecord.from_dict(old, "tucker").format == "dense"
    assert RunRecord.from_dict({**old, "tt": True}, "tucker").format == "tucker"
    with pytest.raises(comera.ConfigError, match="format=3"):
        RunRecord("m", 3)


# -- checkpoints of before ----------------------------------------------------------------------
@pytest.mark.parametrize(("name", "config"), [("comera", CFG), ("dense", DENSE)])
def test_an_engine_checkpoint_written_with_the_tt_flag_resumes(tmp_path, name, config):
    task = ToyTask(dropout=0.2)
    whole, rec_whole = train_model(task, name, config, tmp_path / "a")
    train_model(task, name, config, tmp_path / "b", stop_after=7)
    path = tmp_path / "b" / "checkpoints" / f"{name}.pt"
    write_engine_state_as_before_formats(path)
    assert "tt" in read_torch_file(path)["extra"]["engine"]
    resumed, rec_resumed = train_model(task, name, config, tmp_path / "b", resume=True)
    _assert_identical(_params(whole), _params(resumed))
    assert rec_resumed.format == config.format
    assert rec_whole.train_curve == rec_resumed.train_curve


def test_a_checkpoint_of_before_refuses_another_format(tmp_path):
    train_model(ToyTask(), "comera", CFG, tmp_path, stop_after=2)
    write_engine_state_as_before_formats(tmp_path / "checkpoints" / "comera.pt")
    same_model = lambda: ToyTask().build_model("tt")  # noqa: E731  (only the format differs)
    with pytest.raises(comera.CheckpointError, match=r"\(format 'tt'\), not 'toy' "
                                                     r"\(format 'tucker'\)"):
        train_model(ToyTask(), "comera", replace(CFG, format="tucker"), tmp_path, resume=True,
                    build=same_model)


# -- the default is TT-matrix now; what the flag's era wrote still reads as TT (issue 40) -------
def test_the_default_is_ttm_and_a_state_of_the_flag_era_names_tt():
    assert EngineConfig().format == "ttm"
    assert engine_state_format({"format": "btt"}) == "btt"
    # before EngineConfig had a format: its config names none, and TT was the only format
    assert engine_state_format({"tt": True, "config": {}}) == "tt"
    assert engine_state_format({"tt": False, "config": {}}) == "dense"
    assert engine_state_format({"tt": True, "config": {"format": "tucker"}}) == "tucker"
    assert engine_state_format({"tt": 1, "config": {}}) is None  # damaged: refused on resume


@pytest.mark.parametrize("name", ["comera", "dense"])
def test_a_checkpoint_of_before_engine_formats_resumes_as_tt_not_the_default(tmp_path, name):
    task = ToyTask()
    config = CFG if name == "comera" else DENSE
    whole, rec_whole = train_model(task, name, config, tmp_path / "a")
    train_model(task, name, config, tmp_path / "b", stop_after=7)
    path = tmp_path / "b" / "checkpoints" / f"{name}.pt"
    write_engine_state_as_before_formats(path, config_format=False)
    assert "format" not in read_torch_file(path)["extra"]["engine"]["config"]
    assert run_checkpoint_format(path) == config.format  # tt (or dense), what a resume builds
    resumed, rec_resumed = train_model(task, name, config, tmp_path / "b", resume=True)
    _assert_identical(_params(whole), _params(resumed))
    assert rec_resumed.format == config.format and rec_whole.train_curve == rec_resumed.train_curve


def test_resuming_a_tt_run_under_the_default_is_refused_naming_the_fix(tmp_path):
    train_model(ToyTask(), "comera", CFG, tmp_path, stop_after=2)
    write_engine_state_as_before_formats(tmp_path / "checkpoints" / "comera.pt",
                                         config_format=False)
    with pytest.raises(comera.CheckpointError, match=r"\(format 'tt'\), not 'toy' \(format "
                                                     r"'ttm'\); resume it with format='tt' "
                                                     r"\(comera train --format tt\)"):
        train_model(ToyTask(), "comera", replace(CFG, format="ttm"), tmp_path, resume=True)


def test_run_checkpoint_format_refuses_a_file_of_no_run(tmp_path):
    path = tmp_path / "plain.pt"
    comera.save_checkpoint(path, ToyTask().build_model("tt"))
    with pytest.raises(comera.CheckpointError, match="not written by the training engine"):
        run_checkpoint_format(path)


def test_a_record_of_the_flag_era_reads_as_tt_from_a_dict_and_a_pickle():
    old = {"name": "m", "tt": True, "steps": 3}
    assert RunRecord.from_dict(old).format == "tt"  # no run format given: TT, not the default
    for flag, kind in ((True, "tt"), (False, "dense")):
        record = RunRecord("m", "btt", steps=3)
        state = {k: v for k, v in vars(record).items() if k != "format"}
        loaded = pickle.loads(pickle.dumps(_Pickled(RunRecord, {**state, "tt": flag})))
        assert type(loaded) is RunRecord and loaded.format == kind and loaded.steps == 3


def test_a_config_pickled_before_the_run_had_a_format_loads_as_tt():
    state = {k: v for k, v in vars(CFG).items() if k != "format"}
    old = pickle.loads(pickle.dumps(_Pickled(EngineConfig, state)))
    assert type(old) is EngineConfig and old.format == "tt" and old == CFG
    assert pickle.loads(pickle.dumps(EngineConfig())).format == "ttm"  # today's keeps its own
    assert asdict(pickle.loads(pickle.dumps(DENSE))) == asdict(DENSE)


class _Pickled:
    """Pickles as an instance of ``cls`` with the state ``state``: what an object of the code
    before wrote into a pickle (its ``__dict__``)."""

    def __init__(self, cls: type, state: dict):
        self.cls, self.state = cls, state

    def __reduce__(self):
        return _new, (self.cls,), self.state


def _new(cls: type):
    return cls.__new__(cls)
