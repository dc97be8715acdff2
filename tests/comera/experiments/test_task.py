"""The layer kind a task builds: a format name or "dense" (the boolean of before is read for one
release, with a warning), and the index stream's subsets."""

from __future__ import annotations

import pytest
import torch

import comera
from comera.experiments.task import model_format, spread_subset
from comera.formats.registry import layer_formats
from tests.helpers.toy_task import ToyTask


def test_a_layer_kind_is_dense_or_a_format_built_from_modes():
    assert layer_formats()[0] == "dense" and "tt" in layer_formats()
    assert "einsum" not in layer_formats()  # declared by an equation only
    for kind in layer_formats():
        assert model_format(kind) == kind
    for bad in ("einsum", "bogus", "", None, 3):
        with pytest.raises(comera.ConfigError, match="choose one of dense, tt"):
            model_format(bad)


def test_the_boolean_of_before_still_builds_for_one_release():
    with pytest.warns(DeprecationWarning, match="takes a format now: 'tt'"):
        assert model_format(True) == "tt"
    with pytest.warns(DeprecationWarning, match="'dense'"):
        assert model_format(False) == "dense"
    task = ToyTask()
    torch.manual_seed(0)
    new = task.build_model("tt")
    torch.manual_seed(0)
    with pytest.warns(DeprecationWarning):
        old = task.build_model(True)
    assert all(torch.equal(a, b) for a, b in zip(new.state_dict().values(),
                                                 old.state_dict().values(), strict=True))


def test_spread_subset_is_fixed_ascending_and_capped():
    assert torch.equal(spread_subset(5, None, 0), torch.arange(5))
    assert torch.equal(spread_subset(5, 9, 0), torch.arange(5))
    sub = spread_subset(100, 10, 3)
    assert len(sub) == 10 and torch.equal(sub, sub.sort().values)
    assert torch.equal(sub, spread_subset(100, 10, 3))


class _OldTask(ToyTask):
    """A task written before formats: build_model(self, tt)."""

    def build_model(self, tt: bool):  # the old protocol
        return super().build_model("tt" if tt else "dense")


def test_the_engine_still_trains_a_task_written_with_build_model_tt(tmp_path):
    from comera.experiments.engine import EngineConfig, train_model
    from comera.experiments.task import build_task_model

    with pytest.warns(DeprecationWarning, match="build_model\\(self, tt\\)"):
        dense = build_task_model(_OldTask(), "dense")
    assert not any(True for _ in comera.gated_layers(dense))  # "dense" is not read as truthy
    cfg = EngineConfig(steps_early=2, steps_late=0, batch_size=8, eval_every=1, format="tt")
    with pytest.warns(DeprecationWarning):
        model, _ = train_model(_OldTask(), "comera", cfg, tmp_path / "a")
    assert isinstance(model[0], comera.TTLinear)
    with pytest.raises(comera.ConfigError, match="knows TT and dense only"):
        build_task_model(_OldTask(), "tucker")
    # the default (TT-matrix) is refused before anything trains, naming the format it knows
    with pytest.raises(comera.ConfigError, match=r"not format 'ttm'; train it with "
                                                 r"format='tt' \(EngineConfig\(format='tt'\)\)"):
        train_model(_OldTask(), "comera", EngineConfig(), tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_each_task_builds_its_recommended_format_by_default():
    """``build_model()`` builds what ``comera train`` trains when no format is named: TT-matrix
    for the LM and MLM (issue 40), TT for the DLRM and the classifiers (their results')."""
    import inspect

    from comera.experiments.dlrm_task import DLRMTask
    from comera.experiments.lm_task import LMTask
    from comera.experiments.mlm_task import MLMTask
    from comera.experiments.task import Task
    from comera.experiments.transformer_task import PairClassificationTask
    from comera.layers.linear import FRESH_FORMAT

    expected = {Task: FRESH_FORMAT, LMTask: "ttm", MLMTask: "ttm", DLRMTask: "tt",
                PairClassificationTask: "tt"}
    for task, format in expected.items():
        default = inspect.signature(task.build_model).parameters["format"].default
        chosen = (task.recommended_format if isinstance(task.recommended_format, str)
                  else task.__new__(task).recommended_format)  # a classifier's property
        assert chosen == default == format, task
    assert ToyTask().recommended_format == FRESH_FORMAT == "ttm"
