"""comera.ranks.sensitivity: the choice of one measured candidate per layer under a budget."""

from __future__ import annotations

import itertools
import math

import pytest

from comera.errors import ConfigError
from comera.ranks.sensitivity import (
    LADDER,
    Candidate,
    LayerSensitivity,
    allocate_sensitivity,
    ladder_sizes,
)


def _layer(name, points, uniform):
    """A layer from (rank, size, loss) triples; bonds are (rank,)."""
    return LayerSensitivity(name, tuple(Candidate((r,), s, loss) for r, s, loss in points),
                            (uniform,))


def _best(layers, budget, base):
    """The exact optimum by enumeration: the least summed increase within the budget."""
    best = math.inf
    for pick in itertools.product(*(s.candidates for s in layers)):
        if sum(c.size for c in pick) <= budget:
            best = min(best, sum(c.loss - base for c in pick))
    return best


def test_ladder_spans_a_quarter_to_four_shares_capped_at_dense():
    assert LADDER[0] == 0.25 and LADDER[-1] == 4.0 and len(LADDER) == 9
    sizes = ladder_sizes(100, 300)
    assert sizes[0] == 25 and sizes[-1] == 300 and 100 in sizes
    assert sizes == sorted(set(sizes))
    with pytest.raises(ConfigError, match="share=0"):
        ladder_sizes(0, 10)


def test_a_sensitive_layer_gets_the_parameters_and_the_budget_holds():
    # "hard": its loss falls steeply with size; "easy" barely moves
    hard = _layer("hard", [(1, 10, 5.0), (2, 20, 3.0), (4, 40, 1.5), (8, 80, 1.1)], 2)
    easy = _layer("easy", [(1, 10, 1.02), (2, 20, 1.01), (4, 40, 1.005), (8, 80, 1.0)], 2)
    out = allocate_sensitivity([hard, easy], budget=50, base=1.0)
    assert out.kept == "sensitivity"
    assert out.ranks == {"hard": (4,), "easy": (1,)}
    assert out.size <= 50
    assert out.increase == pytest.approx(0.5 + 0.02)
    assert out.uniform_increase == pytest.approx(2.0 + 0.01)
    assert out.increase == pytest.approx(_best([hard, easy], 50, 1.0))


def test_uniform_comes_back_where_the_greedy_sum_is_not_lower():
    # every layer's uniform candidate is already its best: nothing to move
    a = _layer("a", [(1, 10, 2.0), (2, 20, 1.0)], 2)
    b = _layer("b", [(1, 10, 2.0), (2, 20, 1.0)], 2)
    out = allocate_sensitivity([a, b], budget=40, base=1.0)
    assert out.kept == "uniform" and out.ranks == {"a": (2,), "b": (2,)}
    assert out.increase == out.uniform_increase == pytest.approx(0.0)


def test_a_non_convex_ladder_jumps_past_a_useless_step():
    # the middle candidate of "a" gains nothing; the top one gains a lot
    a = _layer("a", [(1, 10, 3.0), (2, 20, 3.0), (4, 40, 1.0)], 2)
    b = _layer("b", [(1, 10, 1.5), (2, 20, 1.4), (4, 40, 1.3)], 2)
    out = allocate_sensitivity([a, b], budget=50, base=1.0)
    assert out.ranks["a"] == (4,) and out.size <= 50
    assert out.increase == pytest.approx(_best([a, b], 50, 1.0))


def test_a_nan_loss_is_never_chosen():
    a = _layer("a", [(1, 10, 2.0), (2, 20, float("nan")), (3, 30, 1.5)], 2)
    out = allocate_sensitivity([a], budget=30, base=1.0)
    assert out.ranks == {"a": (3,)}


def test_refusals():
    a = _layer("a", [(1, 10, 2.0), (2, 20, 1.0)], 2)
    with pytest.raises(ConfigError, match="cheapest candidates"):
        allocate_sensitivity([a], budget=5)
    with pytest.raises(ConfigError, match="own name"):
        allocate_sensitivity([a, a], budget=100)
    with pytest.raises(ConfigError, match="budget=inf"):
        allocate_sensitivity([a], budget=math.inf)
    with pytest.raises(ConfigError, match="uniform bonds \\[3\\]"):
        _layer("a", [(1, 10, 2.0)], 3)
