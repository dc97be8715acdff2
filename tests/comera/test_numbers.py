"""comera.numbers.is_int: the one rule every whole-number setting is checked by."""

import pytest

from comera.numbers import is_int


@pytest.mark.parametrize(("value", "low", "high", "ok"), [
    (1, 1, None, True), (0, 1, None, False), (0, 0, None, True), (-5, None, None, True),
    (True, 1, None, False), (False, None, None, False),  # a bool is never a count
    (2.0, 1, None, False), ("3", 1, None, False), (None, 1, None, False),
    (64, 1, 64, True), (65, 1, 64, False), (10**400, 1, None, True), (10**400, 1, 64, False),
])
def test_an_int_not_a_bool_within_its_bounds(value, low, high, ok):
    assert is_int(value, low, high) is ok
