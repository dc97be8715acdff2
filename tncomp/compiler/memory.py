"""Memory as a planning objective: which forward intermediates a plan saves, which it recomputes.

A plan's backward reads some forward intermediates (``Plan.saved``); in a TT layer they are
larger than the layer's input, so they, not the weights, set the training step's peak memory.
Each saved slot can instead be *recomputed*: the backward replays the forward steps that made it
(from the operands, which autograd keeps anyway, and from the slots still saved), just before
its first use, and frees it after its last. The replayed steps are ordinary plan steps, so the
device model prices them like any other and the executors run them unchanged.

The modes (``tncomp.compile(net, memory=...)``):

- ``"fast"``: save every intermediate the backward reads (the least time; the default).
- ``"min"``: save none: the backward replays every forward step it needs (the floor of saved
  memory: only the operands are held between the passes).
- ``"balanced"``: drop saves greedily, the most bytes per modelled second first, while the
  replayed steps add at most ``BALANCED_MAX_SLOWDOWN`` (10%) to the plan's modelled forward +
  backward time.
- an int: a budget in bytes for the saved intermediates at the bound sizes: drop saves greedily
  (most bytes per modelled second first) until they fit. ``"min"`` is the floor: a budget below
  it (0, say) gives the ``"min"`` plan.

Trees are scored under the mode too: a tree whose intermediates are cheaper to recompute can win
in ``"min"`` where another wins in ``"fast"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from tncomp.compiler.device_model import DeviceModel
from tncomp.compiler.plan import Plan, frees_after
from tncomp.compiler.problem import Problem, SizeExpr
from tncomp.errors import OptionError, PlanError

MEMORY_CHOICES = ("fast", "balanced", "min")
BALANCED_MAX_SLOWDOWN = 0.10  # "balanced" accepts this much more modelled time for its savings

Memory = str | int
"""A memory mode: one of :data:`MEMORY_CHOICES`, or a budget in bytes (an int >= 0)."""


def check_memory(memory: object) -> Memory:
    """``memory`` if it is a mode, else an :class:`OptionError` naming it and the choices."""
    if isinstance(memory, str) and memory in MEMORY_CHOICES:
        return memory
    if isinstance(memory, int) and not isinstance(memory, bool) and memory >= 0:
        return int(memory)
    raise OptionError(
        f"memory={memory!r}; choose one of {', '.join(repr(c) for c in MEMORY_CHOICES)}, or a "
        "budget in bytes for the saved intermediates (an int >= 0)."
    )


MEMORY_LIMIT_ENV = "TNCOMP_MEMORY_LIMIT"  # bytes: the memory limit of every plan


def check_memory_limit(value: object, where: str = "memory_limit") -> int | None:
    """``value`` as a memory limit (an int of bytes >= 1, or None for the default), else an
    :class:`OptionError` naming it (``where``: the option or variable it came from)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise OptionError(
        f"{where}={value!r}; give the most bytes a plan may hold at once as an int >= 1 (e.g. "
        "8 * 2**30), or None for the default (half of the device's memory)."
    )


def memory_limit_setting(option: int | None, environ: Mapping[str, str]) -> int | None:
    """The memory limit ``compile`` plans under: ``option``, else ``$TNCOMP_MEMORY_LIMIT``
    (an int of bytes), else None (the device's default, known when a call binds a device)."""
    if option is not None:
        return check_memory_limit(option)
    text = environ.get(MEMORY_LIMIT_ENV, "").strip()
    if not text:
        return None
    value: object = int(text) if text.isascii() and text.isdigit() else text
    return check_memory_limit(value, f"${MEMORY_LIMIT_ENV}")


def describe_memory(memory: Memory) -> str:
    """The mode as a report prints it."""
    return f"budget {memory:,} bytes" if isinstance(memory, int) else memory


def with_recompute(plan: Plan, drop: Iterable[int]) -> Plan:
    """``plan`` with the saved slots ``drop`` recomputed in the backward instead of saved.

    Before each backward step, the forward steps making any dropped slot it reads are replayed
    (their own dropped inputs first); the frees are recomputed, so a replayed value lives from
    its first backward use to its last."""
    if plan.recomputed:
        raise PlanError("with_recompute takes a plan that recomputes nothing (internal).")
    drop = set(drop) & set(plan.saved)
    if not drop:
        return plan
    n = plan.n_operands
    producer = {op.dst: op for op in plan.forward}
    kept = [s for s in plan.saved if s not in drop]
    ready = set(range(n)) | set(kept)
    backward = []

    def rebuild(slot: int) -> None:
        if slot in ready or slot >= plan.dy_slot:
            return
        op = producer[slot]
        for r in op.reads:
            rebuild(r)
        backward.append(replace(op, note=f"{op.note} (recompute)"))
        ready.add(slot)

    for op in plan.backward:
        for r in op.reads:
            rebuild(r)
        backward.append(op)
    keep_fwd = set(kept) | {plan.output_slot} | set(range(n))
    keep_bwd = {s for s in plan.grad_slots if s is not None} | set(range(n))
    return replace(plan, backward=tuple(backward), saved=tuple(kept),
                   forward_frees=frees_after(plan.forward, keep_fwd),
                   backward_frees=frees_after(backward, keep_bwd),
                   recomputed=tuple(sorted(drop)))


def apply_memory(plan: Plan, memory: Memory, model: DeviceModel) -> Plan:
    """``plan`` (saving everything, as lowered) under the memory mode ``memory``."""
    if memory == "fast" or not plan.saved:
        return plan
    if memory == "min":
        return with_recompute(plan, plan.saved)
    base = plan.modelled_time(model)
    if memory == "balanced":
        limit = base * (1 + BALANCED_MAX_SLOWDOWN)
        return _greedy(plan, model, lambda p: False, limit)
    budget = int(memory)
    return _greedy(plan, model, lambda p: p.saved_bytes <= budget, float("inf"))


def _greedy(plan: Plan, model: DeviceModel, enough, time_limit: float) -> Plan:
    """Drop saves one at a time, the most bytes freed per added modelled second first, until
    ``enough(plan)`` or no drop keeps the modelled time within ``time_limit``."""
    current, dropped = plan, set()
    current_time = plan.modelled_time(model)
    while not enough(current) and len(dropped) < len(plan.saved):
        best = None
        for s in plan.saved:
            if s in dropped:
                continue
            trial = with_recompute(plan, dropped | {s})
            time = trial.modelled_time(model)
            freed = current.saved_bytes - trial.saved_bytes
            if time > time_limit or freed <= 0:
                continue
            score = (max(time - current_time, 0.0) / freed, -freed, s)
            if best is None or score < best[0]:
                best = (score, s, trial, time)
        if best is None:
            break
        _, s, current, current_time = best
        dropped.add(s)
    return current


def saved_formula(plan: Plan, problem: Problem) -> SizeExpr:
    """The bytes ``plan`` saves as a formula in the symbolic sizes of ``problem`` (the
    network's unbound problem): valid wherever the same tree saves the same slots."""
    return sum((problem.volume(plan.layouts[s]) for s in plan.saved), start=0) * plan.itemsize
