"""Conversion is bit-identical to main's before the formats owned their calibration (see
conversion_pins.py): every format, plain and calibrated, uniform rank, uniform target and
global budget; cores, biases, gates, layer classes, ranks and reported errors. One deliberate
change: CP now calibrates (a format calibrates iff it has a plain decomposition), so its
calibrated conversions beat the pinned ones, which were CP's plain decomposition."""

from __future__ import annotations

import pytest
import torch

from tests.comera.surgery.conversion_pins import PINS, cases, convert

PINNED = torch.load(PINS, weights_only=True)
NOW_CALIBRATED = ("cp-rank-cal", "cp-target-cal")


def test_every_case_is_pinned():
    assert set(PINNED) == set(cases())


@pytest.mark.parametrize("name", sorted(set(cases()) - set(NOW_CALIBRATED)))
def test_conversion_matches_the_pin(name):
    got, want = convert(*cases()[name]), PINNED[name]
    assert got["classes"] == want["classes"]
    assert got["ranks"] == want["ranks"]
    assert got["calibrated"] == want["calibrated"]
    assert got["errors"] == want["errors"]
    assert set(got["state"]) == set(want["state"])
    for key, value in want["state"].items():
        assert got["state"][key].dtype == value.dtype, key
        assert torch.equal(got["state"][key], value), key


@pytest.mark.parametrize("name", NOW_CALIBRATED)
def test_cp_calibrated_conversion_beats_its_plain_decomposition(name):
    got, want = convert(*cases()[name]), PINNED[name]
    assert got["ranks"] == want["ranks"] and got["classes"] == want["classes"]
    for new, old in zip(got["errors"], want["errors"], strict=True):
        assert new < 0.95 * old, (got["errors"], want["errors"])
