"""What a compiled network looks like: the text report (``inspect``), the drawing of the network
and its tree (``drawing_of``, ``draw_network``) and the cost curves over the batch size
(``cost_curves``, ``plot_costs``).

The views take values (plans, trees, regime tables) and never compile; these public functions
compile first (a Network, or a CompiledNetwork as it is), then hand the values to the views.
matplotlib is imported only when a picture is drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tncomp import errors
from tncomp.api import CompiledNetwork, compile
from tncomp.compiler.device_model import DeviceModel
from tncomp.compiler.ir import Network, bind_dims
from tncomp.compiler.plan import lower
from tncomp.compiler.problem import problem_for
from tncomp.views import costplot, draw, report
from tncomp.views.costplot import CostCurves
from tncomp.views.draw import NetworkDrawing

__all__ = ["cost_curves", "draw_network", "drawing_of", "inspect", "plot_costs"]


def _compiled(net_or_compiled: Any, where: str) -> CompiledNetwork:
    """The :class:`CompiledNetwork` of a Network (compiled here) or a compiled one."""
    if isinstance(net_or_compiled, CompiledNetwork):
        return net_or_compiled
    if isinstance(net_or_compiled, Network):
        return compile(net_or_compiled)
    raise errors.TncompError(f"{where} takes a tncomp.Network (from tt_linear, from_eq, ...) or "
                             f"a compiled one, got {type(net_or_compiled).__name__}.")


def inspect(net: Network, batch: int | None = None, *, measure: bool = False,
            threads: int | None = None, **compile_options: Any) -> str:
    """The cost/regime/plan report of ``net`` as text (what ``tncomp inspect`` prints), each
    step of the plan with its roofline floor; with ``memory=`` (a ``compile`` option) it shows
    what that mode saves and what it recomputes. ``measure`` runs the plan on random float32
    CPU operands and shows the time each step took beside its floor
    (:func:`tncomp.runtime.profile.measure_plan`), at ``threads`` threads (default: the current
    count), after checking that the operands and the plan fit the memory limit ``compile``
    plans under; a run far slower than modelled is measured again, and a warning says when it
    stays so (a busy machine)."""
    if threads is not None:
        from tncomp.runtime.device_timing import check_threads

        if not measure:
            raise errors.OptionError(f"threads={threads!r} sets the threads a measurement runs "
                                     "on; pass measure=True too (--measure on the command "
                                     "line), or leave threads out.")
        threads = check_threads(threads)
    compiled = net if isinstance(net, CompiledNetwork) else compile(net, **compile_options)
    network = compiled.network
    batch = report.shown_batch(network, batch)
    needs_grad = (True,) * len(network.operands)
    model = compiled.model("cpu")
    sizes = bind_dims(network, batch)
    plan = compiled.plan_for(sizes, needs_grad)
    table = (compiled.regimes(needs_grad, plan.itemsize, model) if len(network.dims) == 1
             else None)
    saving_all = lower(problem_for(network, sizes), plan.tree, needs_grad, plan.itemsize,
                       model=model)
    measured = None
    if measure:
        from tncomp.runtime.device_timing import using_threads
        from tncomp.runtime.profile import measure_plan

        shapes = [tuple(sizes[i] for i in t.indices) for t in network.operands]
        with using_threads(threads):
            measured = measure_plan(plan, shapes, memory_limit=compiled.memory_limit("cpu"),
                                    model=model)
    return report.report(network, plan, model, batch, table, compiled.options.memory,
                         saving_all.saved_bytes, measured)


def drawing_of(net_or_compiled: Any, batch: int | None = None) -> NetworkDrawing:
    """Everything :func:`draw_network` shows, computed without drawing (no matplotlib)."""
    compiled = _compiled(net_or_compiled, "draw_network")
    net = compiled.network
    batch = draw.representative_batch(net, batch, "draw_network")
    tree = compiled.plan_for(bind_dims(net, batch), (True,) * len(net.operands)).tree
    return draw.network_drawing(net, tree, batch)


def draw_network(net_or_compiled: Any, path: str | Path, batch: int | None = None,
                 ) -> NetworkDrawing:
    """Draw the network (tensors, labelled bonds, dangling open indices) and, beside it, the
    forward contraction tree chosen for training, each step labelled with its FLOPs at
    ``batch`` (default 4096 within the symbol's bounds). Writes a picture to ``path``."""
    from tncomp.views.figures import check_output_path

    path = check_output_path(path)  # before compiling: a bad path fails fast
    return draw.draw(drawing_of(net_or_compiled, batch), path)


def cost_curves(
    net_or_compiled: Any,
    batch_range: Sequence[int] | None = None,
    *,
    points: int = costplot.DEFAULT_POINTS,
    needs_grad: Sequence[bool] | None = None,
    itemsize: int = 4,
    model: DeviceModel | None = None,
    name: str | None = None,
    memory: str | int | None = None,
) -> CostCurves:
    """FLOPs, modelled fwd+bwd time and bytes saved for the backward of every candidate plan
    and of the dense layer, at about ``points`` batch sizes over ``batch_range`` (default: the
    symbol's bounds, up to 65536).

    ``needs_grad`` defaults to every operand (training); ``model`` to the compiled network's
    model for the CPU; ``name`` (e.g. the command line's SPEC) is quoted in errors; ``memory``
    (a ``compile`` memory mode) to the compiled network's: plans are timed and sized under it.
    """
    compiled = _compiled(net_or_compiled, "cost_curves")
    if memory is not None:
        compiled = compiled.with_memory(memory)
    request = costplot.curve_request(
        compiled.network, batch_range, points, needs_grad, itemsize,
        model if model is not None else compiled.model("cpu"), name, compiled.options.memory)
    table = compiled.regimes(request.needs_grad, request.itemsize, request.model)
    return costplot.curves_of(compiled.network, table, request)


def plot_costs(
    net_or_compiled: Any,
    path: str | Path,
    batch_range: Sequence[int] | None = None,
    *,
    show_memory: bool = False,
    **options: Any,
) -> CostCurves:
    """Draw FLOPs and modelled time against the batch size (log-log) for every candidate plan
    and the dense layer, with the regime breakpoints as vertical lines and the plan chosen in
    each regime drawn thick; ``show_memory`` adds the bytes each plan saves for the backward
    (under ``memory=``, default the compiled network's mode). Writes ``path``; returns the
    numbers (see :func:`cost_curves`)."""
    from tncomp.views.figures import check_output_path

    path = check_output_path(path)
    return costplot.draw_costs(cost_curves(net_or_compiled, batch_range, **options), path,
                               show_memory)
