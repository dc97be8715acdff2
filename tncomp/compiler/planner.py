"""The planner: binding -> Tree -> Plan, and every cache key.

A :class:`Planner` belongs to one network compiled with one set of :class:`Options`. It turns
bound sizes into a plan (from the batch regime table, the disk cache, or a search), measures
candidates through a timer the runtime passes in when autotuning, and builds every key: the
per-call binding key, the in-memory plan key and the disk keys. It takes the device model as an
argument and the dtype as values (item size, dtype name), never torch objects, so planning is
built and tested without torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tncomp.compiler.cache import DiskCache
from tncomp.compiler.cost import tree_costs
from tncomp.compiler.device_model import DeviceModel
from tncomp.compiler.ir import Network, bind_dims, structural_key
from tncomp.compiler.memory import MEMORY_LIMIT_ENV, Memory, apply_memory
from tncomp.compiler.ops import transpose_gemms
from tncomp.compiler.plan import Plan, lower
from tncomp.compiler.problem import Problem, Tree, problem_for
from tncomp.compiler.regimes import (
    RegimeTable,
    build_regimes,
    regimes_from_payload,
    regimes_to_payload,
)
from tncomp.compiler.search import candidate_trees, choose_plan, implausible
from tncomp.errors import CacheError, MemoryLimitError, TncompError

log = logging.getLogger("tncomp.compiler.planner")

OPTIMIZE_CHOICES = ("auto", "search", "flops")
AUTOTUNE_TOP_K = 3  # candidates timed by autotune: the modelled best and the next two
# The rules that choose among candidates (search.choose_plan, regimes.build_regimes) as part
# of the disk keys of what they chose: a change of rule must not read the old choices back.
# 2: search.prefer_lean on uncalibrated device models.
CHOICE_RULES = ("choice rules", 2)

Timer = Callable[[Sequence[Plan], Sequence[tuple[int, ...]]], Sequence[float]]
"""Measured seconds of each plan run on operands of the given shapes (the runtime's autotune)."""
Orienter = Callable[[Plan], tuple[tuple[int, ...], tuple[int, ...]]]
"""Positions of the forward and backward GEMMs that measured faster transposed (autotune)."""


@dataclass(frozen=True)
class Options:
    """Everything that changes the plan a network gets (part of every cache key)."""

    optimize: str = "auto"
    autotune: bool = False
    cuda_graphs: bool = False
    pool_buffers: bool = True
    memory: Memory = "fast"  # see tncomp.compiler.memory
    memory_limit: int | None = None  # bytes a plan may hold at once (None: the device's default)

    @property
    def memory_part(self) -> tuple:
        """The memory mode as disk keys hold it: nothing for ``"fast"``, so the entries
        written before memory modes existed stay valid."""
        return () if self.memory == "fast" else (("memory", self.memory),)


def binding_key(operands: Sequence[Any], grad: bool) -> tuple:
    """The per-network key of a call: each operand's shape, dtype, device and whether it needs a
    gradient. It reads attributes only, so it needs no torch import. ``CompiledNetwork.__call__``
    builds the same tuple inline (the hot path saves a function call); a test checks they agree."""
    return tuple((t.shape, t.dtype, t.device, grad and t.requires_grad) for t in operands)


class Planner:
    """Plans of one network under one :class:`Options`; owns the keys and the regime tables."""

    def __init__(self, net: Network, options: Options, disk: DiskCache | None):
        self.network = net
        self.options = options
        self.disk = disk
        self.structure = structural_key(net)
        # Bound sizes enter keys in the structural key's canonical index order, so relabelled
        # networks share entries and equal labels with other roles do not.
        self._canonical = tuple(dict.fromkeys(
            i for t in (*net.operands, net.output) for i in t.indices))
        self._regimes: dict = {}

    def clear(self) -> None:
        """Forget the regime tables built in this process (the disk keeps its entries)."""
        self._regimes.clear()

    # -- keys -----------------------------------------------------------------------------------
    def bound(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """The bound sizes in canonical index order (what every key holds)."""
        return tuple(sizes[i] for i in self._canonical)

    def memory_key(self, sizes: Mapping[str, int], dtype_name: str, device_name: str,
                   needs_grad: Sequence[bool], model: DeviceModel) -> tuple:
        """The key of a runner in the process-wide plan cache. ``device_name`` is the whole
        device (``cuda:1``, not ``cuda``): a runner's pooled buffers live on one device. The
        device model picks the tree, so it is part of the key: networks planned with different
        models do not share plans."""
        return (self.structure, self.bound(sizes), dtype_name, device_name, tuple(needs_grad),
                self.options, model)

    def tree_key(self, sizes: Mapping[str, int], needs_grad: Sequence[bool], itemsize: int,
                 model: DeviceModel) -> tuple:
        """The disk key of a searched tree."""
        return ("tree", self.structure, self.bound(sizes), tuple(needs_grad), itemsize,
                self.options.optimize, model, *self.options.memory_part, CHOICE_RULES)

    def regimes_key(self, needs_grad: Sequence[bool], itemsize: int, model: DeviceModel) -> tuple:
        """The disk key of a regime table."""
        return ("regimes", self.structure, tuple(needs_grad), itemsize, model,
                *self.options.memory_part, CHOICE_RULES)

    def autotune_key(self, sizes: Mapping[str, int], needs_grad: Sequence[bool], dtype_name: str,
                     device_type: str) -> tuple:
        """The disk key of an autotuned tree (measured on a device type, for a dtype)."""
        return ("autotune", self.structure, self.bound(sizes), tuple(needs_grad), dtype_name,
                device_type, self.options.optimize, *self.options.memory_part)

    # -- planning -------------------------------------------------------------------------------
    def plan_for(self, sizes: Mapping[str, int], needs_grad: Sequence[bool], itemsize: int,
                 model: DeviceModel, *, dtype_name: str = "float32", device_type: str = "cpu",
                 timer: Timer | None = None, orient: Orienter | None = None,
                 memory_limit: int | None = None) -> Plan:
        """The plan at these bound sizes: the tree of :meth:`tree_for` (or, with ``autotune``
        and a ``timer``, the measured fastest of the best candidates, its heaviest GEMMs in the
        orientation ``orient`` measured fastest) lowered with its backward, under the memory
        mode. A plan the search already lowered is reused, not lowered again.

        ``memory_limit`` (bytes): a plan whose :attr:`~Plan.peak_bytes` exceeds it is replaced
        by the fastest candidate that fits (under the memory mode, then ``"min"``), and when
        none does a :class:`~tncomp.errors.MemoryLimitError` says so before anything runs."""
        needs_grad = tuple(bool(g) for g in needs_grad)
        problem = problem_for(self.network, sizes)
        tree, plan = self._choose(problem, sizes, needs_grad, itemsize, model)
        if self.options.autotune and timer is not None:
            key = self.autotune_key(sizes, needs_grad, dtype_name, device_type)
            plan = self._autotuned(key, problem, sizes, needs_grad, itemsize, model,
                                   tree, plan, timer, orient)
        elif plan is None:
            plan = self._lower(problem, tree, needs_grad, itemsize, model)
        if memory_limit is not None and plan.peak_bytes > memory_limit:
            plan = self._within(problem, sizes, plan, needs_grad, itemsize, model, memory_limit)
        return plan

    def _within(self, problem: Problem, sizes: Mapping[str, int], plan: Plan,
                needs_grad: tuple[bool, ...], itemsize: int, model: DeviceModel,
                limit: int) -> Plan:
        """The fastest candidate plan whose peak fits ``limit`` (under the memory mode, then
        recomputing everything), else a :class:`MemoryLimitError` naming the sizes."""
        trees = candidate_trees(problem)
        least = plan
        for memory in dict.fromkeys((self.options.memory, "min")):
            for candidate in choose_plan(problem, needs_grad, itemsize, model, trees,
                                         memory).plans:
                if candidate.peak_bytes <= limit:
                    log.debug("memory limit %d: a plan of peak %d bytes (memory=%r) replaces "
                              "one of %d", limit, candidate.peak_bytes, memory, plan.peak_bytes)
                    return candidate
                least = min(least, candidate, key=lambda p: p.peak_bytes)
        bound = ", ".join(f"{i}={sizes[i]}" for i in self._canonical if i in sizes)
        raise MemoryLimitError(
            f"every plan of this network ({len(self.network.operands)} tensors; {bound}) needs "
            f"more memory than the limit of {_bytes(limit)}: the chosen one "
            f"{_bytes(plan.peak_bytes)} at its peak, the leanest of {len(trees)} candidate "
            f"trees {_bytes(least.peak_bytes)} even with memory='min' (every intermediate "
            "recomputed). Shrink the network (smaller bonds or batch), or raise the limit with "
            f"compile(..., memory_limit=BYTES) or ${MEMORY_LIMIT_ENV}.")

    def _lower(self, problem: Problem, tree: Tree, needs_grad: tuple[bool, ...], itemsize: int,
               model: DeviceModel) -> Plan:
        """``tree`` lowered, then saving what the memory mode lets it save."""
        plan = lower(problem, tree, needs_grad, itemsize, model=model)
        return apply_memory(plan, self.options.memory, model)

    def tree_for(self, sizes: Mapping[str, int], needs_grad: Sequence[bool], itemsize: int,
                 model: DeviceModel) -> Tree:
        """The contraction tree at these bound sizes: read from the batch regime table
        (``optimize="auto"``, one symbolic size), else searched (least modelled time, or fewest
        FLOPs for ``"flops"``) and kept in the disk cache when there is one."""
        needs_grad = tuple(bool(g) for g in needs_grad)
        problem = problem_for(self.network, sizes)
        return self._choose(problem, sizes, needs_grad, itemsize, model)[0]

    def _choose(self, problem: Problem, sizes, needs_grad: tuple[bool, ...], itemsize: int,
                model: DeviceModel) -> tuple[Tree, Plan | None]:
        """The tree, and its plan when the search lowered it already."""
        net = self.network
        if self.options.optimize == "auto" and len(net.dims) == 1:
            table = self.regimes(needs_grad, itemsize, model)
            index = next(i for i, s in net.sizes if getattr(s, "name", None) == table.dim.name)
            return table.tree_for(sizes[index]), None
        key = self.tree_key(sizes, needs_grad, itemsize, model)
        n = len(net.operands)

        def parse(payload: object) -> Tree:
            return _trusted(Tree.from_payload(payload, n_leaves=n), problem, needs_grad,
                            itemsize)

        stored = self._load(key, parse)
        if stored is not None:
            return stored, None
        plan = None
        if self.options.optimize == "flops":
            tree = min(candidate_trees(problem),
                       key=lambda t: tree_costs(problem, t, needs_grad).total_flops)
        else:
            plan = choose_plan(problem, needs_grad, itemsize, model,
                               memory=self.options.memory).plan
            tree = plan.tree
        self._store(key, tree.to_payload())
        return tree, plan

    def _autotuned(self, key: tuple, problem: Problem, sizes, needs_grad: tuple[bool, ...],
                   itemsize: int, model: DeviceModel, default: Tree, default_plan: Plan | None,
                   timer: Timer, orient: Orienter | None) -> Plan:
        """The measured fastest of ``default`` and the model's next best candidates, with the
        GEMM orientations ``orient`` measured; tree, swaps and orientations are kept on disk,
        so a process pays for the timing once."""
        n = len(self.network.operands)

        def parse(payload: object) -> tuple[Tree, list[bool], tuple[list[int], list[int]]]:
            if not (isinstance(payload, dict) and isinstance(payload.get("swaps"), list)
                    and isinstance(payload.get("flips"), list) and len(payload["flips"]) == 2
                    and all(isinstance(f, list) for f in payload["flips"])):
                raise CacheError("an autotuned entry holds tree, swaps and flips")
            tree = _trusted(Tree.from_payload(payload.get("tree"), n_leaves=n), problem,
                            needs_grad, itemsize)
            if len(payload["swaps"]) != len(tree.steps):
                raise CacheError("one swap per step")
            return tree, [bool(s) for s in payload["swaps"]], tuple(payload["flips"])

        stored = self._load(key, parse)
        if stored is not None:
            tree, swaps, (fwd, bwd) = stored
            try:
                return _transposed(apply_memory(
                    lower(problem, tree, needs_grad, itemsize, swaps=swaps, model=model),
                    self.options.memory, model), fwd, bwd)
            except ValueError as exc:  # positions that are not GEMMs: a stale entry
                log.warning("autotune: ignoring a stored entry (%s); timing again", exc)
        ranked = choose_plan(problem, needs_grad, itemsize, model,
                             memory=self.options.memory).plans
        if default_plan is None:
            default_plan = next((p for p in ranked if p.tree == default), None) or self._lower(
                problem, default, needs_grad, itemsize, model)
        plans = [default_plan, *[p for p in ranked if p.tree != default][:AUTOTUNE_TOP_K - 1]]
        shapes = [tuple(sizes[i] for i in t.indices) for t in self.network.operands]
        times = list(timer(plans, shapes))
        order = sorted(range(len(plans)), key=times.__getitem__)
        log.debug("autotune: %s", [(f"{times[k] * 1e3:.3f} ms", plans[k].tree.steps)
                                   for k in order])
        best = plans[order[0]]
        fwd, bwd = orient(best) if orient is not None else ((), ())
        log.debug("autotune: GEMMs run transposed: forward %s, backward %s", fwd, bwd)
        self._store(key, {"tree": best.tree.to_payload(), "swaps": list(best.swaps),
                          "flips": [list(fwd), list(bwd)], "times": [times[k] for k in order]})
        return _transposed(best, fwd, bwd)

    def regimes(self, needs_grad: Sequence[bool] | None = None, itemsize: int = 4,
                model: DeviceModel | None = None) -> RegimeTable:
        """The batch-size regimes of a network with one symbolic size (built once, cached in
        this process and on disk). ``model`` is required; ``needs_grad`` defaults to all."""
        net = self.network
        if len(net.dims) != 1:
            raise TncompError(
                f"regimes need exactly one symbolic size; this network has "
                f"{len(net.dims)} ({', '.join(d.name for d in net.dims)})."
            )
        needs_grad = (tuple(bool(g) for g in needs_grad) if needs_grad is not None
                      else (True,) * len(net.operands))
        local_key = (needs_grad, itemsize, model)
        table = self._regimes.get(local_key)
        if table is not None:
            return table
        key = self.regimes_key(needs_grad, itemsize, model)

        def parse(payload: object) -> RegimeTable:
            table = regimes_from_payload(net.dims[0], payload, n_leaves=len(net.operands))
            for regime in table.regimes:  # each tree at both ends of its range
                for value in {regime.lo, regime.hi}:
                    _trusted(regime.tree, problem_for(net, bind_dims(net, value)), needs_grad,
                             itemsize)
            return table

        table = self._load(key, parse)
        if table is None:
            table = build_regimes(net, needs_grad, itemsize, model, self.options.memory)
            self._store(key, regimes_to_payload(table))
        self._regimes[local_key] = table
        return table

    def _load(self, key: tuple, parse: Callable[[Any], Any]) -> Any | None:
        return self.disk.load(key, parse) if self.disk is not None else None

    def _store(self, key: tuple, payload: Any) -> None:
        if self.disk is not None:
            self.disk.store(key, payload)


def _trusted(tree: Tree, problem: Problem, needs_grad: Sequence[bool], itemsize: int) -> Tree:
    """``tree`` as read from the disk cache, or a :class:`CacheError` (the entry is then logged
    and rebuilt) when it is far worse than a fresh greedy tree (see
    :func:`~tncomp.compiler.search.implausible`)."""
    reason = implausible(problem, tree, needs_grad, itemsize)
    if reason is not None:
        raise CacheError(f"a stored tree is far worse than greedy: {reason}")
    return tree


def _bytes(n: int) -> str:
    """A byte count as a message shows it: ``4.00 GiB (4294967296 bytes)``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit} ({n} bytes)"
    return f"{n} bytes"


def _transposed(plan: Plan, fwd: Sequence[int], bwd: Sequence[int]) -> Plan:
    """``plan`` with the forward GEMMs at ``fwd`` and the backward ones at ``bwd`` run
    transposed (:func:`~tncomp.compiler.ops.transpose_gemms`)."""
    if not fwd and not bwd:
        return plan
    return replace(plan, forward=transpose_gemms(plan.forward, fwd),
                   backward=transpose_gemms(plan.backward, bwd))
