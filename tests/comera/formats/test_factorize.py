"""Balanced factorizations of layer sizes (comera.formats.factorize)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comera.errors import ConfigError, FactorizationError
from comera.formats.factorize import (
    _best_factorization,
    _prime_factors,
    factorize,
    factorize_pair,
    suggest_padded_size,
)


@pytest.mark.parametrize(
    ("n", "d", "expected"),
    [
        (768, 3, (8, 8, 12)),
        (3072, 3, (12, 16, 16)),
        (1024, 2, (32, 32)),
        (512, 3, (8, 8, 8)),
        (128, 3, (4, 4, 8)),
        (4096, 6, (4, 4, 4, 4, 4, 4)),
        (6, 3, (1, 2, 3)),  # fewer prime factors than modes: 1s are unavoidable
        (1, 3, (1, 1, 1)),
        (2, 2, (1, 2)),
        (3, 2, (1, 3)),
        (7, 1, (7,)),  # d = 1: any n, primes included
        (2**40, 8, (32,) * 8),
    ],
)
def test_examples(n: int, d: int, expected: tuple[int, ...]) -> None:
    assert factorize(n, d) == expected


def test_factorize_pair() -> None:
    assert factorize_pair(768, 3072, 3) == ((8, 8, 12), (12, 16, 16))


def _brute_force(n: int, d: int) -> list[tuple[int, ...]]:
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    return [t for t in itertools.product(divisors, repeat=d) if math.prod(t) == n]


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 400), d=st.integers(1, 4))
def test_search_is_optimal_against_brute_force(n: int, d: int) -> None:
    best = _best_factorization(n, d)
    everything = _brute_force(n, d)
    assert len(best) == d and math.prod(best) == n and list(best) == sorted(best)
    smallest_max = min(max(t) for t in everything)
    assert max(best) == smallest_max
    largest_min = max(min(t) for t in everything if max(t) == smallest_max)
    assert min(best) == largest_min  # then the smallest spread
    if len(_prime_factors_of(n)) >= d:
        assert 1 not in best  # 1s only when n has fewer than d prime factors


def _prime_factors_of(n: int) -> list[int]:
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 200_000), d=st.integers(1, 5))
def test_factorize_product_length_and_order(n: int, d: int) -> None:
    try:
        factors = factorize(n, d)
    except FactorizationError as error:
        assert str(suggest_padded_size(n, d)) in str(error)
        return
    assert len(factors) == d
    assert math.prod(factors) == n
    assert list(factors) == sorted(factors)
    assert max(factors) ** d <= 4**d * n


@pytest.mark.parametrize(("n", "d"), [(5, 2), (7, 3), (10007, 2), (30011, 4)])
def test_primes_raise_with_padded_suggestion(n: int, d: int) -> None:
    with pytest.raises(FactorizationError) as info:
        factorize(n, d)
    message = str(info.value)
    assert str(n) in message and "prime" in message
    assert str(suggest_padded_size(n, d)) in message


def test_unbalanced_size_raises_with_padded_suggestion() -> None:
    # 30522 = 2 * 3 * 5087 (the BERT vocabulary): 5087 is far too large a mode.
    with pytest.raises(FactorizationError) as info:
        factorize(30522, 4)
    padded = suggest_padded_size(30522, 4)
    assert str(padded) in str(info.value)
    assert padded > 30522
    assert max(factorize(padded, 4)) ** 4 <= 2**4 * padded


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 50_000), d=st.integers(1, 5))
def test_suggest_padded_size_is_smallest_balanced(n: int, d: int) -> None:
    m = suggest_padded_size(n, d)
    assert m >= n
    assert max(_best_factorization(m, d)) ** d <= 2**d * m

    def good(size: int) -> bool:  # balanced, and made of primes <= 7 only (for d >= 2)
        smooth = d == 1 or max(_prime_factors(size), default=1) <= 7
        return smooth and max(_best_factorization(size, d)) ** d <= 2**d * size

    assert good(m)
    for smaller in range(n, m):
        assert not good(smaller)
    factorize(m, d)  # a suggested size never raises


@pytest.mark.parametrize(("n", "d"), [(0, 2), (-4, 2), (8, 0), (8, -1), (True, 2), (8.0, 2)])
def test_bad_arguments_raise(n: object, d: object) -> None:
    with pytest.raises(FactorizationError):
        factorize(n, d)  # type: ignore[arg-type]
    with pytest.raises(FactorizationError):
        suggest_padded_size(n, d)  # type: ignore[arg-type]


def test_hierarchy() -> None:
    assert issubclass(FactorizationError, ConfigError)
    assert issubclass(FactorizationError, ValueError)
