"""The budget rules: the largest uniform rank within a budget (against a brute-force scan and
the layers themselves, every format), and one size target behind every stage constructor."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import comera
from comera.formats.registry import format_names, get_format
from comera.layers.cached_embedding import CachedTTEmbedding
from comera.ranks.budget import (
    check_ratio,
    dense_linear_size,
    largest_rank,
    linear_size,
    size_target,
    uniform_rank,
)
from comera.training.early import EarlyStage

FORMATS = [f for f in format_names() if get_format(f).from_modes]


def _scan(size, budget: float, limit: int) -> int:
    """The rule by hand: walk up, keep the first rank of each new size that fits."""
    best, previous = 0, None
    for r in range(1, limit + 1):
        now = size(r)
        if now > budget:
            break
        if now != previous:
            best, previous = r, now
    return best


def test_largest_rank_agrees_with_a_scan_on_capped_sizes():
    rng = random.Random(0)
    for _ in range(300):
        caps = [rng.randint(1, 40) for _ in range(rng.randint(1, 5))]
        weights = [rng.randint(1, 9) for _ in caps]

        def size(r, caps=caps, weights=weights):
            return sum(w * min(r, c) for w, c in zip(weights, caps, strict=True)) + 7

        limit = rng.choice([1, 5, 64, 1000])
        for budget in (0, 7, 8, rng.uniform(8, 400), 10_000):
            assert largest_rank(size, budget, limit) == _scan(size, budget, limit), (
                caps, weights, budget, limit)


def test_largest_rank_is_zero_below_rank_one_and_stops_at_the_caps():
    assert largest_rank(lambda r: 10 * r, 9) == 0
    assert largest_rank(lambda r: 10 * r, 10) == 1
    assert largest_rank(lambda r: 10 * min(r, 6), 1e9) == 6  # every larger rank is the same
    assert largest_rank(lambda r: 10 * r, 1e9, limit=37) == 37
    calls = []
    largest_rank(lambda r: calls.append(r) or r, 1e9)
    assert len(set(calls)) < 60  # O(log MAX_RANK) sizes, not a scan
    with pytest.raises(comera.ConfigError, match="limit=0"):
        largest_rank(lambda r: r, 5, limit=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_uniform_rank_is_the_largest_whose_layers_fit(fmt):
    shapes = [(12, 20, True), (20, 12, False), (12, 12, True)]
    dense = dense_linear_size(shapes)
    assert dense == 12 * 20 + 20 + 20 * 12 + 12 * 12 + 12
    for target in (1.5, 3, 6):
        budget = dense / target
        rank = uniform_rank(fmt, shapes, budget)

        def built(r):  # the layers themselves, counted
            return sum(comera.GatedLinear(i, o, format=fmt, ranks=r, bias=b).num_parameters()
                       for i, o, b in shapes)

        assert rank == _scan(built, budget, 64), (fmt, target)
        if rank:
            assert linear_size(fmt, shapes, rank) == built(rank) <= budget


def _model() -> nn.Module:
    torch.manual_seed(0)
    table = CachedTTEmbedding(comera.TTEmbedding(64, 8, (4, 4, 4), (2, 2, 2), ranks=3), 5)
    return nn.ModuleDict({"tt": comera.TTLinear(12, 20, (2, 2, 3), (2, 2, 5), ranks=3),
                          "table": table, "head": nn.Linear(8, 2)})


def test_one_size_target_behind_every_stage_constructor():
    model = _model()
    tt, table = model["tt"], model["table"]
    outside = sum(p.numel() for p in model["head"].parameters())
    cache = table.cache.numel()
    dense = tt.dense_num_parameters() + table.tt.dense_num_parameters()
    expected = dense / 4 + outside  # the hot rows count inside the budget, with their table
    assert size_target(model, 4) == pytest.approx(expected)
    assert comera.model_size(model) == tt.num_parameters() + table.tt.num_parameters() + cache \
        + outside
    assert comera.late_stage_for(model, 4, steps=10).target_size == size_target(model, 4)
    assert comera.LateStage.for_compression(model, 4).target_size == size_target(model, 4)
    assert EarlyStage.for_compression(model, 4).target_size == size_target(model, 4)
    only = size_target(model, 4, of=comera.TTLinear)
    assert only == pytest.approx(tt.dense_num_parameters() / 4 + comera.model_size(model)
                                 - tt.num_parameters())


@pytest.mark.parametrize("bad", [1, 0.5, float("inf"), float("nan"), True, "4", None])
def test_a_ratio_is_a_finite_number_above_one(bad):
    with pytest.raises(comera.ConfigError, match="compression"):
        check_ratio(bad, "compression")
    with pytest.raises(comera.ConfigError, match="ratio="):
        size_target(_model(), bad)
