"""A study row's pieces: the block layers' sizes and ranks of every kind, and the curves."""

from __future__ import annotations

from torch import nn

from benchmarks.studies.harness.runs import curves, layer_ranks, layer_shapes, layer_sizes
from comera import GatedLinear, TTLinear
from comera.experiments.engine import RunRecord


def test_sizes_and_ranks_count_each_kind_of_layer():
    dense = [("a", nn.Linear(32, 16))]
    assert layer_sizes(dense) == (32 * 16 + 16, 32 * 16 + 16) and layer_ranks(dense) == {}
    low = [("a", GatedLinear(32, 16, "lowrank", 3))]
    assert layer_sizes(low) == (3 * 48 + 16, 32 * 16 + 16)
    assert layer_ranks(low) == {"a": [3]}
    tt = [("a", TTLinear(32, 16, (4, 8), (4, 4), ranks=2)), ("b", nn.Linear(4, 4, bias=False))]
    assert layer_sizes(tt) == (4 * 2 + 2 * 8 * 2 + 2 * 4 * 2 + 2 * 4 + 16 + 16,
                               32 * 16 + 16 + 16)
    assert layer_ranks(tt) == {"a": [1, 2, 2, 2, 1]}
    assert layer_shapes(tt) == [(32, 16, True), (4, 4, False)]


def test_curves_pair_each_evaluation_with_its_training_clock():
    record = RunRecord("m", "tt", train_curve=[(0, 3.0, 3.1, "loss"), (1, 2.0, 2.1, "loss")],
                       val_curve=[(0, {"loss": 3.5}), (2, {"loss": 2.5})],
                       val_seconds=[0.0, 1.23456])
    assert curves(record) == {"train": [[0, 3.0], [1, 2.0]],
                              "val": [[0, 0.0, {"loss": 3.5}], [2, 1.235, {"loss": 2.5}]]}
    old = RunRecord("m", "tt", val_curve=[(0, {"loss": 3.5})])  # a record from before clocks
    assert curves(old)["val"] == [[0, None, {"loss": 3.5}]]
