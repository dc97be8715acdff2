"""Balanced integer factorizations of layer sizes into tensor modes.

A tensor-train layer reshapes a size ``n`` into ``d`` modes whose product is ``n``. The modes
should be as equal as possible (all close to ``n ** (1 / d)``): an unbalanced mode inflates the
TT ranks needed and the cost of the contractions. Sizes with no balanced factorization (primes,
``2 * large prime``) are refused with a suggested padded size that has one.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator

from comera.errors import FactorizationError
from comera.numbers import as_whole

# ``factorize`` refuses a best factorization whose largest factor exceeds this multiple of the
# ideal ``n ** (1 / d)``; ``suggest_padded_size`` looks for one within ``_PAD_SLACK`` of it.
_MAX_SLACK = 4
_PAD_SLACK = 2


def _as_int(value: object, name: str, minimum: int) -> int:
    """``value`` as an int >= ``minimum``, or a FactorizationError saying why not."""
    return as_whole(value, name, minimum, FactorizationError, not_int="; pass a whole number")


def _prime_factors(n: int) -> list[int]:
    """Prime factors of ``n >= 1`` with multiplicity, ascending (trial division)."""
    factors: list[int] = []
    p = 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1 if p == 2 else 2
    if n > 1:
        factors.append(n)
    return factors


def _divisors(n: int) -> list[int]:
    """All divisors of ``n >= 1``, ascending."""
    divisors = {1}
    for p in _prime_factors(n):
        divisors |= {q * p for q in divisors}
    return sorted(divisors)


def _ascending_factorizations(
    n: int, d: int, cap: int, divisors: list[int], lo: int = 1
) -> Iterator[tuple[int, ...]]:
    """Every ascending ``d``-tuple of factors in ``[lo, cap]`` whose product is ``n``."""
    if d == 1:
        if lo <= n <= cap:
            yield (n,)
        return
    for f in divisors[bisect_left(divisors, lo) :]:
        if f**d > n or f > cap:  # ascending: the remaining d - 1 factors are all >= f
            break
        if n % f or n // f > cap ** (d - 1):
            continue
        for rest in _ascending_factorizations(n // f, d - 1, cap, divisors, f):
            yield (f, *rest)


def _balance_key(factors: tuple[int, ...]) -> tuple[int, int, tuple[int, ...]]:
    """Sort key of an ascending factorization: largest factor, then spread, then the rest."""
    return (factors[-1], factors[-1] - factors[0], tuple(reversed(factors)))


def _best_factorization(n: int, d: int) -> tuple[int, ...]:
    """The most balanced ascending factorization of ``n`` into ``d`` factors (no checks)."""
    divisors = _divisors(n)
    for cap in divisors:
        if cap**d < n:  # d factors <= cap cannot reach n
            continue
        candidates = list(_ascending_factorizations(n, d, cap, divisors))
        if candidates:  # the smallest feasible cap is the minimal largest factor
            return min(candidates, key=_balance_key)
    raise AssertionError("unreachable: (1, ..., 1, n) is always a factorization")


def _integer_root_cap(m: int, d: int, slack: int) -> int:
    """The largest int ``c`` with ``c ** d <= slack ** d * m``, i.e. ``c <= slack * m**(1/d)``."""
    bound = slack**d * m
    c = int(slack * m ** (1.0 / d))
    while c**d > bound:
        c -= 1
    while (c + 1) ** d <= bound:
        c += 1
    return c


def _has_factorization_under(m: int, d: int, cap: int) -> bool:
    """Whether ``m`` splits into ``d`` factors that are all ``<= cap``, from primes <= 7 only
    (so suggested sizes factor into modes like 8, 10, 12, 16, not 13 or 71)."""
    if max(_prime_factors(m), default=1) > min(cap, 7):
        return False
    divisors = _divisors(m)
    return next(_ascending_factorizations(m, d, cap, divisors), None) is not None


def suggest_padded_size(n: int, d: int) -> int:
    """The smallest ``m >= n`` with a balanced factorization into ``d`` factors.

    Balanced means the largest factor is ``<= 2 * m ** (1 / d)`` and every prime factor is at
    most 7. Pad a layer (or a vocabulary)
    to this size when ``n`` itself factorizes badly, e.g. 30522 -> 30720 for ``d = 4``.
    """
    n = _as_int(n, "n", 1)
    d = _as_int(d, "d", 1)
    if d == 1:
        return n
    m = n
    while not _has_factorization_under(m, d, _integer_root_cap(m, d, _PAD_SLACK)):
        m += 1
    return m


def _unbalanced_error(n: int, d: int, reason: str) -> FactorizationError:
    padded = suggest_padded_size(n, d)
    return FactorizationError(
        f"cannot factorize {n} into {d} balanced tensor modes: {reason}. Expected a size whose "
        f"{d} factors are all close to {n}**(1/{d}) = {n ** (1.0 / d):.2f}. Fix: pad the "
        f"dimension to {padded} = {' x '.join(map(str, _best_factorization(padded, d)))} "
        f"(suggest_padded_size({n}, {d}) = {padded}), or use fewer modes"
    )


def factorize(n: int, d: int) -> tuple[int, ...]:
    """A balanced factorization of ``n`` into exactly ``d`` integer factors, ascending.

    Balanced: the largest factor is as small as possible, then the spread (largest - smallest),
    then the remaining factors from the largest down. Factors of 1 only appear when ``n`` has
    fewer than ``d`` prime factors. Examples: ``factorize(768, 3) == (8, 8, 12)``,
    ``factorize(3072, 3) == (12, 16, 16)``, ``factorize(1024, 2) == (32, 32)``.

    Raises FactorizationError when ``n < 1`` or ``d < 1``, when ``n`` is a prime > 3 and
    ``d >= 2``, or when the best largest factor exceeds ``4 * n ** (1 / d)``; the message names
    ``suggest_padded_size(n, d)``.
    """
    n = _as_int(n, "n", 1)
    d = _as_int(d, "d", 1)
    if d == 1:
        return (n,)
    if n > 3 and _prime_factors(n) == [n]:
        raise _unbalanced_error(n, d, f"{n} is prime, so its only factorization is 1 x ... x {n}")
    best = _best_factorization(n, d)
    if best[-1] ** d > _MAX_SLACK**d * n:
        raise _unbalanced_error(
            n,
            d,
            f"the best factorization {best} has the factor {best[-1]} > "
            f"{_MAX_SLACK} * {n}**(1/{d}) = {_MAX_SLACK * n ** (1.0 / d):.2f}",
        )
    return best


def factorize_pair(
    in_features: int, out_features: int, d: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(in_modes, out_modes)``: balanced ascending factorizations of both sizes into ``d``."""
    return factorize(in_features, d), factorize(out_features, d)
