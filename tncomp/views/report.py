"""Readable reports of a network: costs as formulas, batch regimes, the chosen plan, vs dense.

A view takes values: ``tncomp.inspect`` (and the CLI) compiles, then passes the plan, the
regime table and the device model to :func:`report`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy

from tncomp.compiler.cost import Costs, tree_costs
from tncomp.compiler.device_model import DeviceModel
from tncomp.compiler.ir import Network, Role
from tncomp.compiler.memory import Memory, describe_memory, saved_formula
from tncomp.compiler.plan import Measured, Plan
from tncomp.compiler.problem import Tree, problem_for
from tncomp.compiler.regimes import RegimeTable


def describe_tree(net: Network, tree: Tree) -> str:
    """A tree as a nested product of tensor names, e.g. ``(x.(core1.core2)).core3``."""
    names = [t.name for t in net.operands]
    for a, b in tree.steps:
        names.append(f"({names[a]}.{names[b]})")
    text = names[tree.root]
    return text[1:-1] if text.startswith("(") and text.endswith(")") else text


@dataclass(frozen=True)
class DenseEquivalent:
    """The one-GEMM layer a network with one input and parameter cores stands for."""

    parameters: int
    forward_flops: sympy.Expr | int

    @property
    def total_flops(self):
        return 3 * self.forward_flops


def dense_equivalent(net: Network) -> DenseEquivalent | None:
    """Merge all parameters into one weight W: y = x . W. None for other networks."""
    inputs = [t for t in net.operands if t.role is Role.INPUT]
    params = [t for t in net.operands if t.role is Role.PARAMETER]
    if len(inputs) != 1 or not params:
        return None
    x = inputs[0]
    param_idx = {i for t in params for i in t.indices}
    open_w = param_idx & (set(x.indices) | set(net.output.indices))
    p = problem_for(net)
    w_vol = p.volume(sorted(open_w))
    involved = sorted(set(x.indices) | set(net.output.indices) | open_w)
    return DenseEquivalent(w_vol, 2 * p.volume(involved))


def parameter_count(net: Network) -> int:
    sizes = net.size_dict
    total = 0
    for t in net.operands:
        if t.role is Role.PARAMETER and all(isinstance(sizes[i], int) for i in t.indices):
            total += math.prod(sizes[i] for i in t.indices)
    return total


def _fmt(expr) -> str:
    if isinstance(expr, int | sympy.Integer):
        return f"{int(expr):,}"
    return str(sympy.simplify(expr))


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


DEFAULT_BATCH = 4096


def shown_batch(net: Network, batch: int | None) -> int:
    """The batch a report shows its plan at: ``batch`` (checked against every symbol's bounds),
    by default 4096 clipped to the bounds."""
    for dim in net.dims:
        if batch is None:
            hi = dim.max if dim.max is not None else DEFAULT_BATCH
            batch = max(min(DEFAULT_BATCH, hi), dim.min)
        dim.check(batch, "inspect")
    return DEFAULT_BATCH if batch is None else batch


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def memory_lines(net: Network, plan: Plan, model: DeviceModel, at: str, memory: Memory,
                 saved_by_tree: int) -> list[str]:
    """What ``plan`` keeps for the backward under ``memory``, against ``saved_by_tree`` (the
    bytes the same tree saves in ``"fast"``), and the modelled time its recomputation costs."""
    total = plan.modelled_time(model)
    recompute = plan.recompute_time(model)
    return [f"== memory (mode {describe_memory(memory)}; plan at {at}) ==",
            f"saved for bwd   {_fmt(saved_formula(plan, problem_for(net)))} bytes (this plan's "
            f"intermediates; operands not counted)",
            f"at {at}: saved {_mib(plan.saved_bytes)} ({len(plan.saved)} values); the tree "
            f"saving all: {_mib(saved_by_tree)}",
            f"recompute       {len(plan.recomputed)} values, {len(plan.recompute_ops)} steps, "
            f"{plan.recompute_flops / 1e6:.2f} MFLOP in the backward, modelled "
            f"{recompute * 1e3:.3f} ms of {total * 1e3:.3f} ms", ""]


def report(net: Network, plan: Plan, model: DeviceModel, batch: int,
           table: RegimeTable | None = None, memory: Memory = "fast",
           saved_by_tree: int | None = None, measured: Measured | None = None) -> str:
    """The full report of ``net``: the costs of ``plan``'s tree as formulas, the regime
    ``table`` (for one symbolic size), what ``plan`` saves for the backward under ``memory``
    (``saved_by_tree``: what its tree saves in ``"fast"``, default ``plan``'s), ``plan``
    (bound at ``batch``) with each step's roofline floor under ``model`` (and, ``measured``, the
    time each step took), and the dense layer it stands for."""
    needs_grad, itemsize = plan.needs_grad, plan.itemsize
    lines = ["== network ==", str(net), ""]
    dims = net.dims
    symbolic: Costs = tree_costs(problem_for(net), plan.tree, needs_grad, itemsize)
    at = ", ".join(f"{d.name}={batch}" for d in dims) or "all sizes fixed"
    lines += [f"== costs of the chosen tree (formulas; plan shown at {at}) ==",
              f"tree            {describe_tree(net, plan.tree)}",
              f"forward FLOPs   {_fmt(symbolic.forward_flops)}",
              f"backward FLOPs  {_fmt(symbolic.backward_flops)}",
              f"bytes moved     {_fmt(symbolic.total_bytes)}  (fwd+bwd, {itemsize}-byte items)",
              f"saved for bwd   {_fmt(symbolic.saved_bytes)} bytes (saving every intermediate)",
              f"peak memory     {_fmt(symbolic.peak_bytes)} bytes (intermediates + output)", ""]
    if table is not None:
        lines.append(f"== {dims[0].name} regimes (breakpoints {list(table.breakpoints)}) ==")
        for r in table.regimes:
            lines.append(f"{dims[0].name} in [{r.lo}, {r.hi}]: {describe_tree(net, r.tree)}")
        lines.append("")
    if any(needs_grad):
        lines += memory_lines(net, plan, model, at, memory,
                              plan.saved_bytes if saved_by_tree is None else saved_by_tree)
    floor = plan.floor_time(model)
    lines += [f"== plan at {at} ==",
              plan.table(model, (measured.forward, measured.backward) if measured else None),
              f"roofline floor {floor * 1e3:.3f} ms, modelled time "
              f"{plan.modelled_time(model) * 1e3:.3f} ms ({model.source}: "
              f"{_si(model.gemm_flops_per_s, 'FLOP/s')}, {_si(model.bytes_per_s, 'B/s')}; the "
              "floor of a step: its FLOPs at the GEMM rate or its bytes at bandwidth, whichever "
              "is slower)"]
    if measured is not None:
        lines.append(f"measured {measured.total * 1e3:.3f} ms, {measured.total / floor:.1f}x the "
                     f"floor (median of {measured.repeats} runs, {measured.threads} threads; "
                     f"steps timed one by one: {measured.steps_total * 1e3:.3f} ms; two GEMMs "
                     "run fused, reading one large operand once, show as the first step)")
    lines.append("")
    dense = dense_equivalent(net)
    if dense is not None:
        bound_dense = dense.total_flops.subs({d.symbol: batch for d in dims}) if dims else \
            dense.total_flops
        total = plan.forward_flops + plan.backward_flops
        params = parameter_count(net)
        lines += ["== vs dense ==",
                  f"dense weight    {dense.parameters:,} parameters; cores {params:,} "
                  f"({versus(params, dense.parameters)})",
                  f"dense FLOPs     {_fmt(dense.total_flops)} (fwd+bwd)",
                  f"at {at}: dense {_si(float(bound_dense), 'FLOP')}, plan {_si(total, 'FLOP')} "
                  f"({versus(total, float(bound_dense))})"]
    return "\n".join(lines)


def versus(ours: float, dense: float) -> str:
    """``ours`` against ``dense`` in words: ``"20.0x fewer"``, ``"1.05x more"``, or ``"the
    same"`` (two decimals where one would read 1.0x)."""
    if ours == dense:
        return "the same"
    word = "fewer" if ours < dense else "more"
    if ours <= 0 or dense <= 0:  # no ratio to give
        return word
    ratio = dense / ours if ours < dense else ours / dense
    text = f"{ratio:.1f}"
    if text == "1.0":
        text = f"{ratio:.2f}"
        if text == "1.00":
            return f"about the same ({word})"
    return f"{text}x {word}"
