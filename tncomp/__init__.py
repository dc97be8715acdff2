"""tncomp: a tensor-network compiler for fast, memory-lean tensor-compressed layers.

Declare a layer as a network (``tt_linear``, ``ttm_linear``, ``ttm_embedding``, ``from_eq``),
inspect its costs (``inspect``), and ``compile`` it into a differentiable torch callable whose
forward and backward passes are planned together. ``draw_network`` and ``plot_costs`` make
pictures (matplotlib, imported only when a picture is drawn).
"""

from tncomp import errors
from tncomp.api import CompiledNetwork, cache_info, clear_cache, compile, contract
from tncomp.builders import from_eq, resolve_ranks, tt_linear, ttm_embedding, ttm_linear
from tncomp.cost import Costs, tree_costs
from tncomp.costplot import cost_curves, plot_costs
from tncomp.draw import draw_network, drawing_of
from tncomp.ir import Dim, Network, Role, TensorSpec, make_network
from tncomp.model import DeviceModel
from tncomp.plan import Plan
from tncomp.problem import Problem, Tree, problem_for
from tncomp.report import describe_tree

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
    from tncomp.report import inspect as _inspect

    target = net if isinstance(net, CompiledNetwork) else compile(net, **compile_options)
    return _inspect(target, batch=batch)
