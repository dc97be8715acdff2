"""The rank allocations' results pinned on fixed inputs (tests/comera/ranks/allocator_cases.py),
written before the two greedy allocators became one (issue 43): the late stage's spectrum
allocation (``comera.ranks.allocate.allocate``, energy share per parameter from a floor) and
``convert_``'s global budget (``comera.ranks.global_budget.allocate_budget``, squared-error drop
per parameter from rank 1), and convert_'s ranks through both, must not change by one slice."""

from __future__ import annotations

import pytest

import comera
from comera.ranks.allocate import allocate
from comera.ranks.global_budget import allocate_budget, floor_size
from comera.surgery.config import ConvertConfig
from tests.comera.ranks.allocator_cases import budget_layers, chain_model
from tests.comera.surgery.test_decompose import mlp, skewed

pytestmark = pytest.mark.usefixtures("one_thread")

LATE = {(0.15, "uniform", 1): ({"0": (1, 3, 2, 2, 2, 3, 1),
                         "1": (1, 3, 2, 2, 2, 3, 1),
                         "2": (1, 3, 2, 2, 2, 3, 1),
                         "3": (1, 2, 2, 1)},
                        568),
 (0.15, "one", 1): ({"0": (1, 4, 2, 4, 1, 4, 1),
                     "1": (1, 4, 1, 4, 2, 4, 1),
                     "2": (1, 4, 1, 4, 2, 4, 1),
                     "3": (1, 1, 1, 1)},
                    560),
 (0.15, "one", 2): ({"0": (1, 3, 2, 2, 2, 3, 1),
                     "1": (1, 3, 2, 2, 2, 3, 1),
                     "2": (1, 3, 2, 2, 2, 3, 1),
                     "3": (1, 2, 2, 1)},
                    568),
 (0.3, "uniform", 1): ({"0": (1, 4, 3, 5, 3, 4, 1),
                        "1": (1, 4, 3, 5, 3, 4, 1),
                        "2": (1, 4, 4, 3, 4, 4, 1),
                        "3": (1, 3, 3, 1)},
                       1120),
 (0.3, "one", 1): ({"0": (1, 4, 2, 8, 2, 4, 1),
                    "1": (1, 4, 3, 7, 2, 4, 1),
                    "2": (1, 4, 5, 4, 4, 4, 1),
                    "3": (1, 6, 1, 1)},
                   1132),
 (0.3, "one", 2): ({"0": (1, 4, 2, 8, 2, 4, 1),
                    "1": (1, 4, 4, 7, 3, 4, 1),
                    "2": (1, 4, 5, 4, 4, 4, 1),
                    "3": (1, 2, 2, 1)},
                   1140),
 (0.5, "uniform", 1): ({"0": (1, 4, 5, 5, 6, 4, 1),
                        "1": (1, 4, 5, 5, 5, 4, 1),
                        "2": (1, 4, 5, 5, 5, 4, 1),
                        "3": (1, 5, 5, 1)},
                       1900),
 (0.5, "one", 1): ({"0": (1, 4, 5, 8, 5, 4, 1),
                    "1": (1, 4, 5, 7, 5, 4, 1),
                    "2": (1, 4, 8, 4, 7, 4, 1),
                    "3": (1, 8, 1, 1)},
                   1896),
 (0.5, "one", 2): ({"0": (1, 4, 5, 8, 5, 4, 1),
                    "1": (1, 4, 5, 7, 5, 4, 1),
                    "2": (1, 4, 8, 4, 7, 4, 1),
                    "3": (1, 5, 2, 1)},
                   1896)}
GLOBAL = {1.0: ({"lowrank0": (1,), "tt1": (1, 1, 1), "ttm2": (1,), "tucker3": (1, 1, 1, 1)}, 179),
 1.7: ({"lowrank0": (1,), "tt1": (4, 1, 3), "ttm2": (1,), "tucker3": (4, 1, 2, 4)}, 296),
 3.0: ({"lowrank0": (1,), "tt1": (4, 2, 6), "ttm2": (2,), "tucker3": (4, 1, 6, 4)}, 526),
 6.0: ({"lowrank0": (3,), "tt1": (4, 3, 6), "ttm2": (5,), "tucker3": (4, 3, 5, 4)}, 1060)}
CONVERT = {
    ("tt", False): [(1, 2, 6, 4, 8, 4, 1), (1, 2, 8, 4, 8, 4, 1)],
    ("tt", True): [(1, 2, 6, 5, 7, 4, 1), (1, 2, 8, 4, 8, 4, 1)],
    ("tucker", False): [(2, 3, 2, 2, 4, 4), (2, 1, 4, 2, 3, 4)],
    ("tucker", True): [(2, 3, 4, 2, 4, 1), (2, 4, 4, 2, 3, 2)],
}


def test_the_late_stage_allocation_is_unchanged():
    model = chain_model()
    size = comera.model_size(model)
    assert size == 3808
    for (fraction, floor, min_rank), (ranks, total) in LATE.items():
        allocation = allocate(model, size * fraction, floor, min_rank)
        assert (allocation.ranks, allocation.size) == (ranks, total), (fraction, floor)


def test_the_global_budget_is_unchanged():
    layers = budget_layers()
    floor = floor_size(layers)
    assert floor == 179
    for multiple, (ranks, total) in GLOBAL.items():
        allocation = allocate_budget(layers, floor * multiple)
        assert (allocation.ranks, allocation.size) == (ranks, total), multiple


@pytest.mark.parametrize(("fmt", "calibrated"), list(CONVERT))
def test_convert_global_ranks_are_unchanged(fmt, calibrated):
    model = mlp()
    report = comera.convert_(model, ConvertConfig(format=fmt, target_compression=2,
                                                  allocation="global"),
                             calibration=[skewed(300, 24, 2)] if calibrated else None)
    assert report.kept == "global"
    assert [layer.ranks for layer in report.layers] == CONVERT[fmt, calibrated]
