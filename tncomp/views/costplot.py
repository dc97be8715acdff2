"""FLOPs, modelled time and saved memory against the batch size: every candidate plan, the dense
layer, the regimes.

For a network with one symbolic size, the candidate trees are those the regime search weighs
(found at sampled sizes, each lowered with the GEMM orientations it was found with), so the
curves are exactly what :mod:`tncomp.compiler.regimes` compares: at every size the plan of the
regime table is the lowest modelled-time curve. Each candidate is lowered with its backward pass at
every plotted size; its FLOPs and time come from that plan (what would run), not from a
formula; so do the bytes it saves for the backward under the memory mode (recomputation
priced into its time). A view takes values: the caller (``tncomp.cost_curves`` /
``plot_costs``, the CLI) checks the request with :func:`curve_request`, builds the regime
table, and passes both to :func:`curves_of`; :func:`draw_costs` draws the numbers.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import sympy

from tncomp.compiler.device_model import DeviceModel
from tncomp.compiler.ir import Dim, Network, Role, bind_dims
from tncomp.compiler.memory import Memory, apply_memory, check_memory, describe_memory
from tncomp.compiler.plan import lower
from tncomp.compiler.problem import Tree, problem_for
from tncomp.compiler.regimes import Regime, RegimeTable, regime_candidates
from tncomp.errors import SizeError, TncompError
from tncomp.views.figures import check_output_path, format_count, new_figure, save_figure
from tncomp.views.report import dense_equivalent, describe_tree

log = logging.getLogger("tncomp.views.costplot")

DEFAULT_HI = 1 << 16  # top of the default sweep of an unbounded size
DEFAULT_POINTS = 48


@dataclass(frozen=True)
class CostSeries:
    """One curve: forward+backward FLOPs, modelled seconds and the bytes saved for the backward
    (intermediates beyond the operands) at each plotted batch."""

    label: str
    tree: Tree | None  # None for the dense layer
    flops: tuple[int, ...]
    times: tuple[float, ...]
    saved: tuple[int, ...] = ()  # empty for the dense layer (it saves only its operands)


@dataclass(frozen=True)
class CostCurves:
    """The numbers behind a cost plot (and the picture's path, once drawn)."""

    name: str
    dim: Dim
    batches: tuple[int, ...]
    candidates: tuple[CostSeries, ...]
    dense: CostSeries | None
    regimes: tuple[Regime, ...]  # the regime table, clipped to the plotted range
    chosen: tuple[int, ...]  # for each of ``regimes``, the index of its candidate
    needs_grad: tuple[bool, ...]
    itemsize: int
    model: DeviceModel
    path: Path | None = None
    memory: Memory = "fast"

    @property
    def breakpoints(self) -> tuple[int, ...]:
        """Batches inside the plotted range where a new regime (plan) starts."""
        return tuple(r.lo for r in self.regimes[1:])

    def chosen_at(self, batch: int) -> int:
        """The index of the candidate the regime table runs at ``batch``."""
        for regime, k in zip(self.regimes, self.chosen, strict=True):
            if regime.lo <= batch <= regime.hi:
                return k
        raise SizeError(f"batch {batch} is outside the plotted range "
                        f"[{self.batches[0]}, {self.batches[-1]}].")


def _the_dim(net: Network, name: str) -> Dim:
    dims = net.dims
    if not dims:
        raise SizeError(
            f"{name}: every size is fixed, so there is no batch size to sweep; declare one "
            "symbolic size (e.g. eq:bi,ij->bj:B,768|768,3072, or batch='B' in tt_linear)."
        )
    if len(dims) > 1:
        raise SizeError(
            f"{name} has {len(dims)} symbolic sizes ({', '.join(d.name for d in dims)}); a cost "
            "plot sweeps exactly one: fix the others to ints."
        )
    return dims[0]


def _batch_range(dim: Dim, batch_range: Sequence[int] | None, name: str) -> tuple[int, int]:
    if batch_range is None:
        lo = dim.min
        hi = dim.max if dim.max is not None else max(DEFAULT_HI, 2 * lo)
        if hi <= lo:
            raise SizeError(f"{name}: {dim.name} is fixed at {lo} by its bounds; there is no "
                            "batch range to sweep.")
        return lo, hi
    values = tuple(batch_range)
    if len(values) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise SizeError(f"{name}: batch range {batch_range!r}; give two ints LO HI, e.g. 1 4096.")
    lo, hi = values
    if not lo < hi:
        raise SizeError(f"{name}: batch range {lo}..{hi} is empty; give LO < HI, e.g. 1 4096.")
    dim.check(lo, f"{name}: batch range start")
    dim.check(hi, f"{name}: batch range end")
    return lo, hi


def _clip(regimes: Sequence[Regime], lo: int, hi: int) -> tuple[Regime, ...]:
    """The regimes met in [lo, hi], cut to it (the last regime runs on past the table's end,
    as :meth:`~tncomp.compiler.regimes.RegimeTable.tree_for` does)."""
    inside = [r for r in regimes if r.lo <= hi and (r.hi >= lo or r is regimes[-1])]
    return tuple(Regime(max(r.lo, lo), hi if k == len(inside) - 1 else min(r.hi, hi), r.tree)
                 for k, r in enumerate(inside))


def plotted_batches(lo: int, hi: int, points: int, breakpoints: Sequence[int] = ()) -> list[int]:
    """About ``points`` batches spaced geometrically over [lo, hi], plus both sides of every
    breakpoint inside the range (so each switch of plan shows exactly where it happens)."""
    values = {lo, hi}
    for k in range(points):
        values.add(round(lo * (hi / lo) ** (k / (points - 1))))
    for b in breakpoints:
        values.update(v for v in (b - 1, b) if lo <= v <= hi)
    return sorted(values)


def _as_int(expr: Any, dim: Dim, value: int) -> int:
    if isinstance(expr, sympy.Expr):
        return int(expr.subs(dim.symbol, value))
    return int(expr)


def _dense_series(net: Network, dim: Dim, batches: Sequence[int], needs_grad: Sequence[bool],
                  itemsize: int, model: DeviceModel) -> CostSeries | None:
    """The one-GEMM layer the network compresses: y = x W, plus one GEMM per gradient taken
    (dx = dy W^T if x needs one, dW = x^T dy if any parameter does)."""
    dense = dense_equivalent(net)
    if dense is None:
        return None
    k_x = next(k for k, t in enumerate(net.operands) if t.role is Role.INPUT)
    wants_w = any(g for g, t in zip(needs_grad, net.operands, strict=True)
                  if t.role is Role.PARAMETER)
    n_gemms = 1 + bool(needs_grad[k_x]) + wants_w
    x, y = net.operands[k_x], net.output
    symbolic = problem_for(net)
    flops, times = [], []
    for b in batches:
        fwd = _as_int(dense.forward_flops, dim, b)
        elements = sum(_as_int(v, dim, b) for v in (symbolic.volume(x.indices), dense.parameters,
                                                     symbolic.volume(y.indices)))
        flops.append(n_gemms * fwd)
        times.append(n_gemms * model.op_time(fwd, elements * itemsize))
    label = f"dense layer ({_as_int(dense.parameters, dim, 1):,} weights)"
    return CostSeries(label, None, tuple(flops), tuple(times))


@dataclass(frozen=True)
class CurveRequest:
    """What a cost plot sweeps, checked: the symbol and its range, how many batches, which
    gradients, the item size and the device model, and the name quoted in errors."""

    name: str
    dim: Dim
    lo: int
    hi: int
    points: int
    needs_grad: tuple[bool, ...]
    itemsize: int
    model: DeviceModel
    memory: Memory = "fast"


def curve_request(net: Network, batch_range: Sequence[int] | None, points: int,
                  needs_grad: Sequence[bool] | None, itemsize: int, model: DeviceModel,
                  name: str | None, memory: Memory = "fast") -> CurveRequest:
    """The checked :class:`CurveRequest` (a clear error naming the bad value otherwise)."""
    name = name if name is not None else f"network {net.output.name}"
    dim = _the_dim(net, name)
    lo, hi = _batch_range(dim, batch_range, name)
    if isinstance(points, bool) or not isinstance(points, int) or points < 2:
        raise TncompError(f"{name}: points={points!r}; give an int >= 2.")
    needs_grad = (tuple(bool(g) for g in needs_grad) if needs_grad is not None
                  else (True,) * len(net.operands))
    if len(needs_grad) != len(net.operands):
        raise TncompError(f"{name}: needs_grad has {len(needs_grad)} entries for "
                          f"{len(net.operands)} operands.")
    if not isinstance(model, DeviceModel):
        raise TncompError(f"{name}: model is a {type(model).__name__}; pass a "
                          "tncomp.DeviceModel (or leave it out).")
    return CurveRequest(name, dim, lo, hi, points, needs_grad, itemsize, model,
                        check_memory(memory))


def curves_of(net: Network, table: RegimeTable, request: CurveRequest) -> CostCurves:
    """FLOPs and modelled fwd+bwd time of every regime candidate (the trees
    :func:`~tncomp.compiler.regimes.build_regimes` compares, and any tree of ``table`` found
    elsewhere) and of the dense layer, at the batches of ``request``."""
    name, dim, needs_grad = request.name, request.dim, request.needs_grad
    itemsize, model, memory = request.itemsize, request.model, request.memory
    candidates = regime_candidates(net, needs_grad, itemsize, model)
    by_signature = {tree.signature(): k for k, (tree, _) in enumerate(candidates)}
    for r in table.regimes:  # a table from the disk cache may hold a tree found elsewhere
        if r.tree.signature() not in by_signature:
            by_signature[r.tree.signature()] = len(candidates)
            problem = problem_for(net, bind_dims(net, r.lo))
            candidates.append((r.tree, lower(problem, r.tree, needs_grad, itemsize,
                                             model=model).swaps))
    regimes = _clip(table.regimes, request.lo, request.hi)
    chosen = tuple(by_signature[r.tree.signature()] for r in regimes)
    batches = plotted_batches(request.lo, request.hi, request.points,
                              [r.lo for r in regimes[1:]])

    backward = any(needs_grad)
    flops: list[list[int]] = [[] for _ in candidates]
    times: list[list[float]] = [[] for _ in candidates]
    saved: list[list[int]] = [[] for _ in candidates]
    for b in batches:
        problem = problem_for(net, bind_dims(net, b))
        for k, (tree, swaps) in enumerate(candidates):
            plan = apply_memory(lower(problem, tree, needs_grad, itemsize, swaps=swaps), memory,
                                model)
            flops[k].append(plan.forward_flops + (plan.backward_flops if backward else 0))
            times[k].append(plan.modelled_time(model, backward))
            saved[k].append(plan.saved_bytes)
    series = tuple(
        CostSeries(f"P{k + 1}: {describe_tree(net, tree)}", tree, tuple(f), tuple(t), tuple(m))
        for k, ((tree, _), f, t, m) in enumerate(zip(candidates, flops, times, saved,
                                                     strict=True))
    )
    dense = _dense_series(net, dim, batches, needs_grad, itemsize, model)
    log.debug("cost curves of %s: %d candidates at %d batches", name, len(series), len(batches))
    return CostCurves(name, dim, tuple(batches), series, dense, regimes, chosen, needs_grad,
                      itemsize, model, memory=memory)


def draw_costs(curves: CostCurves, path: str | Path, show_memory: bool = False) -> CostCurves:
    """Draw FLOPs and modelled time against the batch size (log-log) for every candidate plan
    and the dense layer, with the regime breakpoints as vertical lines and the plan chosen in
    each regime drawn thick; ``show_memory`` adds a third panel, the bytes each plan saves for
    the backward under the curves' memory mode. Writes ``path``; returns ``curves`` with the
    path."""
    path = check_output_path(path)
    fig, axes = new_figure(22 if show_memory else 15, 7.5, 3 if show_memory else 2)
    ax_flops, ax_time = axes[:2]
    colours = _colours(len(curves.candidates))
    b = curves.batches
    panels = [(ax_flops, "flops"), (ax_time, "times")]
    if show_memory:
        panels.append((axes[2], "saved"))
    for ax, field in panels:
        for k, s in enumerate(curves.candidates):
            ax.plot(b, getattr(s, field), color=colours[k], lw=1.2, label=_short(s.label))
        for regime, k in zip(curves.regimes, curves.chosen, strict=True):
            idx = [j for j, v in enumerate(b) if regime.lo <= v <= regime.hi]
            ax.plot([b[j] for j in idx], [getattr(curves.candidates[k], field)[j] for j in idx],
                    color=colours[k], lw=7, alpha=0.45, solid_capstyle="butt", zorder=1)
        if curves.dense is not None and getattr(curves.dense, field):
            ax.plot(b, getattr(curves.dense, field), color="black", lw=1.8, ls="--",
                    label=curves.dense.label)
        for bp in curves.breakpoints:
            ax.axvline(bp, color="#888888", ls=":", lw=1.2)
            ax.annotate(f"{curves.dim.name}={bp}", (bp, 1.0), xycoords=("data", "axes fraction"),
                        xytext=(3, -12), textcoords="offset points", fontsize=7, rotation=90,
                        va="top", color="#555555")
        for regime, k in zip(curves.regimes, curves.chosen, strict=True):
            mid = math.sqrt(regime.lo * regime.hi)
            ax.annotate(f"P{k + 1}", (mid, 0.0), xycoords=("data", "axes fraction"),
                        xytext=(0, 4), textcoords="offset points", ha="center", fontsize=8,
                        color=colours[k], fontweight="bold")
        ax.set_xscale("log")
        if field == "saved":  # "min" saves 0 bytes: a log scale cannot show it
            ax.set_yscale("symlog", linthresh=1024)
        else:
            ax.set_yscale("log")
        ax.set_xlabel(f"batch size {curves.dim.name}")
        ax.grid(True, which="major", alpha=0.3)
    grads = "forward + backward" if any(curves.needs_grad) else "forward only"
    ax_flops.set_ylabel(f"FLOPs ({grads})")
    ax_time.set_ylabel(f"modelled time, s ({grads})")
    ax_flops.set_title(f"{curves.name}: FLOPs per step", fontsize=10)
    model = curves.model
    rates = (f"{format_count(model.gemm_flops_per_s, 'FLOP/s')}, "
             f"{format_count(model.bytes_per_s, 'B/s')}")
    ax_time.set_title(f"modelled time ({model.source}: {rates})", fontsize=10)
    if show_memory:
        axes[2].set_ylabel("bytes saved for the backward (beyond the operands)")
        axes[2].set_title(f"saved memory, mode {describe_memory(curves.memory)} (the dense "
                          "layer saves only its operands)", fontsize=10)
    handles, labels = ax_flops.get_legend_handles_labels()
    from matplotlib.lines import Line2D

    handles.append(Line2D([], [], color="#777777", lw=7, alpha=0.45))
    labels.append("plan chosen in its regime (thick); dotted: regime breakpoints")
    fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize=7)
    save_figure(fig, path)
    return replace(curves, path=path)


def _short(label: str, width: int = 80) -> str:
    return label if len(label) <= width else label[: width - 3] + "..."


def _colours(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(k % cmap.N) for k in range(n)]
