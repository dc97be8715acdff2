"""The planning budget: wall-clock seconds the tree search may spend on one plan.

Exact contraction-order search is exponential in the number of operands: opt_einsum's dynamic
program with outer products runs for minutes on small networks of disconnected vectors
(docs/safety.md, "The planning budget"). Every search therefore
runs against a :class:`Budget`: the exact searches check it as they go and stop when it is spent;
cotengra's hyper-optimizer gets what is left as its ``max_time``; once it is spent only the
cheap candidates (greedy, left to right) are made. A plan whose search ran out of budget takes
the best candidate found so far, scored as usual, and says so in the log (INFO).

The budget is a time, not a search size: ``TNCOMP_PLAN_BUDGET_S`` seconds (default
:data:`DEFAULT_BUDGET_S`) per plan, shared by every sampled size of a batch-regime table.
"""

from __future__ import annotations

import logging
import math
import os
import time

from tncomp.errors import OptionError

__all__ = ["BUDGET_ENV", "DEFAULT_BUDGET_S", "Budget", "OutOfBudget", "budget_seconds"]

log = logging.getLogger("tncomp.compiler.budget")

DEFAULT_BUDGET_S = 1.0
BUDGET_ENV = "TNCOMP_PLAN_BUDGET_S"


def budget_seconds() -> float:
    """The search budget in seconds: ``$TNCOMP_PLAN_BUDGET_S``, else the default."""
    raw = os.environ.get(BUDGET_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_BUDGET_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise OptionError(f"{BUDGET_ENV}={raw!r}; set it to a number of seconds >= 0 (0 plans "
                          "greedily), or unset it for the default "
                          f"{DEFAULT_BUDGET_S:g} s.")
    return value


class OutOfBudget(Exception):
    """Raised inside a search when its budget is spent (caught by the search, never escapes)."""


class Budget:
    """A deadline for the searches of one plan; remembers whether a search ran out.

    ``check()`` is cheap enough for an inner loop: it reads the clock every ``every`` calls."""

    def __init__(self, seconds: float | None = None, every: int = 256):
        self.seconds = budget_seconds() if seconds is None else float(seconds)
        self.deadline = time.perf_counter() + self.seconds
        self.every = every
        self._calls = 0
        self.ran_out: list[str] = []  # the searches stopped by the budget

    def remaining(self) -> float:
        """Seconds left (0 when spent)."""
        return max(0.0, self.deadline - time.perf_counter())

    @property
    def spent(self) -> bool:
        return time.perf_counter() >= self.deadline

    def check(self) -> None:
        """Raise :class:`OutOfBudget` once the deadline has passed (read every ``every`` calls)."""
        self._calls += 1
        if self._calls % self.every == 0 and time.perf_counter() >= self.deadline:
            raise OutOfBudget

    def stopped(self, search: str, n_operands: int) -> None:
        """Record (and log at INFO) that ``search`` was cut short by the budget."""
        self.ran_out.append(search)
        log.info("tncomp planner: the %s search over %d operands ran out of its %.3g s budget "
                 "(%s); using the best tree found by the other searches (greedy among them)",
                 search, n_operands, self.seconds, BUDGET_ENV)
