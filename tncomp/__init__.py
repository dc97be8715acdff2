"""tncomp: a tensor-network compiler for fast, memory-lean tensor-compressed layers.

Declare a layer as a network (``tt_linear``, ``ttm_linear``, ``ttm_embedding``, ``from_eq``),
inspect its costs (``tncomp.inspect``), and ``compile`` it into a differentiable torch callable
whose forward and backward passes are planned together. ``draw_network`` and ``plot_costs`` make
pictures (matplotlib, imported only when a picture is drawn).

This module only re-exports what users call. The compiler's intermediate forms stay importable
from their modules: ``Problem``, ``problem_for`` and ``Tree`` from :mod:`tncomp.compiler.problem`,
``Costs`` and ``tree_costs`` from :mod:`tncomp.compiler.cost`, ``Plan`` and ``lower`` from
:mod:`tncomp.compiler.plan`. What a package building its own layers on tncomp needs besides
(mode and rank rules, the autocast rule) is :mod:`tncomp.extend`.

``tncomp.inspect`` is not in ``__all__``: ``from tncomp import *`` would otherwise shadow the
standard library's :mod:`inspect`. Call it as ``tncomp.inspect``.
"""

from tncomp import errors
from tncomp.api import CompiledNetwork, cache_info, clear_cache, compile, contract
from tncomp.compiler.builders import from_eq, stack_siblings, tt_linear, ttm_embedding, ttm_linear
from tncomp.compiler.device_model import DeviceModel
from tncomp.compiler.ir import Dim, Network, Role, TensorSpec, make_network

# The extension interface moved to tncomp.extend: the old names warn until 0.3.0.
from tncomp.extend import tncomp_getattr as __getattr__  # noqa: F401 (PEP 562)
from tncomp.inspection import cost_curves, draw_network, drawing_of, plot_costs

# tncomp.inspect, outside __all__: `from tncomp import *` must not shadow the stdlib's inspect
from tncomp.inspection import inspect as inspect
from tncomp.views.report import describe_tree

__version__ = "0.1.0"

__all__ = [
    "CompiledNetwork",
    "DeviceModel",
    "Dim",
    "Network",
    "Role",
    "TensorSpec",
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
    "make_network",
    "plot_costs",
    "stack_siblings",
    "tt_linear",
    "ttm_embedding",
    "ttm_linear",
]
