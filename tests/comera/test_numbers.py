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


def test_as_whole_says_which_of_bool_not_a_number_or_too_low_and_ends_with_the_hint():
    import numpy as np
    import pytest

    from comera.errors import ConfigError
    from comera.numbers import as_whole

    assert as_whole(3, "n", 1, ConfigError) == 3
    assert as_whole(np.int64(2), "n", 2, ConfigError) == 2  # anything operator.index takes
    with pytest.raises(ConfigError, match=r"^n must be an int >= 1, got the bool True$"):
        as_whole(True, "n", 1, ConfigError)
    with pytest.raises(ValueError, match=r"got float 1\.5; pass a whole number$"):
        as_whole(1.5, "n", 1, ValueError, not_int="; pass a whole number")
    with pytest.raises(ConfigError, match=r"got 0; use 1$"):
        as_whole(0, "a rank", 1, ConfigError, too_low="; use 1")


def test_rank_sequence_names_the_layer_the_fix_and_the_kind():
    import pytest

    from comera.errors import ConfigError
    from comera.formats.bond_ranks import rank_sequence

    assert rank_sequence([2, 3], 2, "ring", "a ring of 2 cores", "2") == (2, 3)
    with pytest.raises(ConfigError, match=r"has 1 entries for a ring of 2 cores; give 2 or one"):
        rank_sequence([2], 2, "ring", "a ring of 2 cores", "2 or one int")
    with pytest.raises(ConfigError, match=r"holds True; every BTT rank is an int >= 1"):
        rank_sequence([2, True], 2, "BTT", "a BTT of 3 cores", "2")
