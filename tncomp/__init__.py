"""tncomp: a tensor-network compiler for fast, memory-lean tensor-compressed layers.

Declare a layer as a network (``tt_linear``, ``ttm_linear``, ``ttm_embedding``, ``from_eq``),
inspect its costs (``inspect``), and ``compile`` it into a differentiable torch callable whose
forward and backward passes are planned together. ``draw_network`` and ``plot_costs`` make
pictures (matplotlib, imported only when a picture is drawn).
"""

from tncomp import errors
from tncomp.api import CompiledNetwork, cache_info, clear_cache, compile, contract
from tncomp.compiler.builders import from_eq, resolve_ranks, tt_linear, ttm_embedding, ttm_linear
from tncomp.compiler.cost import Costs, tree_costs
from tncomp.compiler.device_model import DeviceModel
from tncomp.compiler.ir import Dim, Network, Role, TensorSpec, make_network
from tncomp.compiler.plan import Plan
from tncomp.compiler.problem import Problem, Tree, problem_for
from tncomp.views.costplot import cost_curves, plot_costs
from tncomp.views.draw import draw_network, drawing_of
from tncomp.views.report import describe_tree

__version__ = "0.1.0"

__all__ = [
    "CompiledNetwork",
    "Costs",
    "DeviceModel",
    "Dim",
    "Network",
    "Plan",
    "Problem",
    "Role",
    "TensorSpec",
    "Tree",
    "cache_info",
    "clear_cache",
    "compile",
    "contract",
    "cost_curves",
    "describe_tree",
    "draw_network",
    "drawing_of",
    "errors",
    "from_eq",
    "inspect",
    "make_network",
    "plot_costs",
    "problem_for",
    "resolve_ranks",
    "tree_costs",
    "tt_linear",
    "ttm_embedding",
    "ttm_linear",
]


def inspect(net: Network, batch: int | None = None, **compile_options) -> str:
    """The cost/regime/plan report of ``net`` as text (what ``tncomp inspect`` prints)."""
    from tncomp.views.report import inspect as _inspect

    target = net if isinstance(net, CompiledNetwork) else compile(net, **compile_options)
    return _inspect(target, batch=batch)
