"""The public entry points: ``compile`` a network into a differentiable callable, ``contract``.

``compile(net)`` returns a :class:`CompiledNetwork`: call it with torch tensors in the order of
``net.operands``. The first call at a new binding (shapes, dtype, device, which operands need
gradients) picks a tree (the batch regime, or a search), lowers it with its backward pass,
generates code, and caches the result; later calls are a dict lookup and one autograd Function.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tncomp.compiler.cache import DiskCache, LRUCache, default_cache_dir
from tncomp.compiler.device_model import CPU_DEFAULT, CUDA_DEFAULT, DeviceModel
from tncomp.compiler.ir import Network, bind_sizes, structural_key
from tncomp.compiler.plan import Plan, lower
from tncomp.compiler.problem import Tree, problem_for
from tncomp.compiler.regimes import (
    RegimeTable,
    build_regimes,
    regimes_from_payload,
    regimes_to_payload,
)
from tncomp.compiler.search import choose_plan
from tncomp.errors import IRError, OptionError, TncompError
from tncomp.runtime.autograd import ContractFunction, Runner
from tncomp.runtime.codegen import generate
from tncomp.runtime.library import (
    autocast_operands,
    check_operands,
    empty_result,
    is_empty,
    register,
    traced_call,
)
from tncomp.runtime.library import (
    check_tensors as _check_tensors,
)

log = logging.getLogger("tncomp")
if os.environ.get("TNCOMP_DEBUG"):
    logging.basicConfig()
    log.setLevel(logging.DEBUG)

OPTIMIZE_CHOICES = ("auto", "search", "flops")

# The hot path's checks, bound once (dynamo recognises the functions themselves).
_autocast_on = torch._C._is_any_autocast_enabled
_transforms_on = torch._C._are_functorch_transforms_active
_compiling = torch.compiler.is_compiling

_RUNNERS = LRUCache(maxsize=512)  # process-wide: identical networks share plans
_LIVE: weakref.WeakSet = weakref.WeakSet()  # compiled networks, so clear_cache reaches them


@dataclass(frozen=True)
class Options:
    """Everything that changes the plan a network gets (part of every cache key)."""

    optimize: str = "auto"
    autotune: bool = False
    cuda_graphs: bool = False
    pool_buffers: bool = True


def clear_cache(disk: bool = False) -> None:
    """Drop every in-memory plan and pooled buffer, in the shared cache and in every live
    compiled network (and, with ``disk=True``, the on-disk search results)."""
    for compiled in list(_LIVE):
        compiled.clear()
    _RUNNERS.clear()
    if disk:
        DiskCache().clear()


def cache_info() -> dict:
    """Counters of the in-memory plan cache and the disk cache location."""
    disk = DiskCache()
    return {"plans": len(_RUNNERS), "hits": _RUNNERS.hits, "misses": _RUNNERS.misses,
            "maxsize": _RUNNERS.maxsize, "disk_dir": str(disk.directory),
            "disk_entries": len(disk.entries())}


def model_for(device: torch.device | str) -> DeviceModel:
    """The calibrated model of ``device`` if one was measured, else a default."""
    from tncomp.runtime.calibrate import load_calibration

    device = torch.device(device)
    measured = load_calibration(device)
    if measured is not None:
        return measured
    return CUDA_DEFAULT if device.type == "cuda" else CPU_DEFAULT


class CompiledNetwork:
    """A network compiled into ``(*operands) -> output``, differentiable w.r.t. every operand."""

    def __init__(self, net: Network, options: Options, model: DeviceModel | None,
                 disk_cache: DiskCache | None):
        self.network = net
        self.options = options
        self._model = model
        self._disk = disk_cache
        self._key = structural_key(net)
        # Bound sizes enter keys in the structural key's canonical index order.
        self._canonical_indices = tuple(dict.fromkeys(
            i for t in (*net.operands, net.output) for i in t.indices))
        self._local: dict = {}
        self._regimes: dict = {}
        self._graphed: dict = {}
        self.captures = 0  # CUDA-graph captures made (tests check replays do not re-capture)
        self._op_id = register(self)  # how the tncomp::contract operator refers to it
        _LIVE.add(self)

    def clear(self) -> None:
        """Forget this network's plans, regime tables, graphs and pooled buffers."""
        for runner in self._local.values():
            for pool in runner.code.pools.values():
                pool.clear()
        self._local.clear()
        self._regimes.clear()
        self._graphed.clear()

    # -- the hot path -------------------------------------------------------------------------
    def __call__(self, *operands: torch.Tensor) -> torch.Tensor:
        """Contract ``operands`` (tensors in the order of ``network.operands``) into the output.

        The first call at a new binding (shapes, dtype, device, which operands need gradients)
        builds and caches its plan; later calls look it up. Under autograd the result is
        differentiable w.r.t. every operand that requires grad; with ``cuda_graphs`` a CUDA call
        replays a captured graph.

        Inside ``torch.autocast`` floating operands (not float64) are cast to the autocast dtype
        first, as ``nn.Linear`` does; under ``torch.compile`` the call is one opaque operator
        (``tncomp::contract``), and under torch.func transforms a transform-friendly Function.
        Operands with an empty axis give ``torch.einsum``'s empty (or zero) result."""
        if _autocast_on():
            operands = autocast_operands(operands)
        if _transforms_on() or _compiling():
            return traced_call(self, operands)
        grad = torch.is_grad_enabled()
        try:
            key = tuple((t.shape, t.dtype, t.device, grad and t.requires_grad) for t in operands)
            runner = self._local[key]
        except (KeyError, AttributeError, TypeError):
            if is_empty(operands):
                return empty_result(self.network, operands)
            runner = self._runner_for(operands, grad)
        if self.options.cuda_graphs and operands[0].is_cuda:
            return self._graphed_call(runner, operands)
        if grad and runner.plan.needs_grad.count(True):
            return ContractFunction.apply(runner, *operands)
        return runner.code.forward(*operands)[0]

    def plan_of(self, *operands: torch.Tensor) -> Plan:
        """The plan a call with these operands runs (built and cached now if it is new)."""
        _check_tensors(operands, "plan_of", [t.name for t in self.network.operands])
        grad = torch.is_grad_enabled()
        key = tuple((t.shape, t.dtype, t.device, grad and t.requires_grad) for t in operands)
        runner = self._local.get(key)
        return (runner if runner is not None else self._runner_for(operands, grad)).plan

    # -- building -----------------------------------------------------------------------------
    def _runner_for(self, operands: Sequence[torch.Tensor], grad: bool,
                    needs_grad: Sequence[bool] | None = None) -> Runner:
        """The runner of this binding (``needs_grad`` overrides ``grad and requires_grad``)."""
        check_operands(self.network, operands)
        if needs_grad is None:
            needs_grad = tuple(grad and t.requires_grad for t in operands)
        needs_grad = tuple(bool(g) for g in needs_grad)
        key = tuple((t.shape, t.dtype, t.device, g) for t, g in zip(operands, needs_grad,
                                                                       strict=True))
        runner = self._local.get(key)
        if runner is not None:
            return runner
        sizes = bind_sizes(self.network, [tuple(t.shape) for t in operands])
        dtype, device = operands[0].dtype, operands[0].device
        bound = tuple(sizes[i] for i in self._canonical_indices)
        # The device model picks the tree, so it is part of the key: networks compiled with
        # different models (or one calibrated meanwhile) do not share plans.
        model = self.model(device)
        full_key = (self._key, bound, str(dtype), device.type, needs_grad, self.options, model)

        def build() -> Runner:
            plan = self.plan_for(sizes, needs_grad, dtype, device, model=model)
            shapes = [tuple(t.shape) for t in operands]
            return Runner(plan, generate(plan, shapes, dtype, device, name=self.network.output.name,
                                         pool=self.options.pool_buffers), shapes, dtype, device)

        runner = _RUNNERS.get_or_build(full_key, build, label=f"B={bound}")
        if len(self._local) > 64:
            self._local.clear()
        self._local[key] = runner
        return runner

    def model(self, device: torch.device) -> DeviceModel:
        """The device model that scores plans: the one given to ``compile``, else ``device``'s
        calibrated (or default) model."""
        return self._model if self._model is not None else model_for(device)

    def plan_for(self, sizes: dict[str, int], needs_grad: Sequence[bool],
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", model: DeviceModel | None = None) -> Plan:
        """The plan used at these bound sizes (searching, or reading the regime table), under
        ``model`` (default: the compiled network's model, else the device's)."""
        device = torch.device(device)
        model = model if model is not None else self.model(device)
        itemsize = torch.empty((), dtype=dtype).element_size()
        problem = problem_for(self.network, sizes)
        tree = self.tree_for(sizes, needs_grad, itemsize, model)
        if self.options.autotune:
            from tncomp.runtime.autotune import autotune_tree

            tree = autotune_tree(self, problem, sizes, needs_grad, dtype, device, model, tree)
        return lower(problem, tree, needs_grad, itemsize, model=model)

    def tree_for(self, sizes, needs_grad, itemsize: int, model: DeviceModel) -> Tree:
        """The contraction tree used at these bound sizes: read from the batch regime table
        (``optimize="auto"``, one symbolic size), else searched (least modelled time, or fewest
        FLOPs for ``"flops"``) and kept in the disk cache when there is one."""
        needs_grad = tuple(needs_grad)
        if self.options.optimize == "auto" and len(self.network.dims) == 1:
            table = self.regimes(needs_grad, itemsize, model)
            dim = table.dim
            value = next(sizes[i] for i, s in self.network.sizes
                         if getattr(s, "name", None) == dim.name)
            return table.tree_for(value)
        problem = problem_for(self.network, sizes)
        disk_key = ("tree", self._key, tuple(sorted(sizes.items())), needs_grad, itemsize,
                    self.options.optimize, model)
        stored = self._disk.load(disk_key) if self._disk else None
        if stored is not None:
            return Tree(stored["n"], tuple(tuple(s) for s in stored["steps"]))
        if self.options.optimize == "flops":
            from tncomp.compiler.cost import tree_costs
            from tncomp.compiler.search import candidate_trees

            tree = min(candidate_trees(problem),
                       key=lambda t: tree_costs(problem, t, needs_grad).total_flops)
        else:
            tree = choose_plan(problem, needs_grad, itemsize, model).plan.tree
        if self._disk:
            self._disk.store(disk_key, {"n": tree.n_leaves, "steps": [list(s) for s in tree.steps]})
        return tree

    def regimes(self, needs_grad: Sequence[bool] | None = None, itemsize: int = 4,
                model: DeviceModel | None = None) -> RegimeTable:
        """The batch-size regimes of a network with one symbolic size (built once, cached)."""
        if len(self.network.dims) != 1:
            raise TncompError(
                f"regimes need exactly one symbolic size; this network has "
                f"{len(self.network.dims)} ({', '.join(d.name for d in self.network.dims)})."
            )
        needs_grad = tuple(needs_grad) if needs_grad is not None else (True,) * len(
            self.network.operands)
        model = model or self.model(torch.device("cpu"))
        local_key = (needs_grad, itemsize, model)
        if local_key in self._regimes:
            return self._regimes[local_key]
        disk_key = ("regimes", self._key, needs_grad, itemsize, model)
        stored = self._disk.load(disk_key) if self._disk else None
        table = regimes_from_payload(self.network.dims[0], stored) if stored else None
        if table is None:
            table = build_regimes(self.network, needs_grad, itemsize, model)
            if self._disk:
                self._disk.store(disk_key, regimes_to_payload(table))
        self._regimes[local_key] = table
        return table

    def _graphed_call(self, runner: Runner, operands):
        from tncomp.runtime.cudagraph import graphed_call

        return graphed_call(self, runner, operands)

    def __repr__(self) -> str:
        names = ", ".join(t.name for t in self.network.operands)
        return f"CompiledNetwork(({names}) -> {self.network.output.name}, {self.options})"


def compile(
    net: Network,
    *,
    optimize: str = "auto",
    autotune: bool = False,
    cuda_graphs: bool = False,
    model: DeviceModel | None = None,
    disk_cache: bool | str | os.PathLike = True,
    pool_buffers: bool = True,
) -> CompiledNetwork:
    """Compile ``net`` into a callable ``(*operands) -> output`` with a planned backward pass.

    optimize: ``"auto"`` (batch regimes for one symbolic size, else a search per binding),
    ``"search"`` (always search the bound sizes), or ``"flops"`` (fewest FLOPs, ignoring the
    device model). ``autotune`` times the best few candidates on the device and keeps the
    fastest. ``cuda_graphs`` captures forward and backward into CUDA graphs on a GPU (ignored
    on CPU). ``model``: the :class:`DeviceModel` plans are scored with (default: the device's
    calibration, else a default). ``disk_cache``: True (the default directory), False or None,
    or a directory. ``pool_buffers`` reuses large result buffers between calls once nothing
    references them (a caching allocator; ``tncomp.clear_cache()`` releases them).
    """
    if not isinstance(net, Network):
        raise TncompError(
            f"compile takes a tncomp.Network (from tt_linear, from_eq, ...), got "
            f"{type(net).__name__}."
        )
    options, model, directory = _settings(optimize, autotune, cuda_graphs, model, disk_cache,
                                          pool_buffers)
    return CompiledNetwork(net, options, model, _disk(directory))


def _settings(optimize: str = "auto", autotune: bool = False, cuda_graphs: bool = False,
              model: DeviceModel | None = None, disk_cache: bool | str | os.PathLike = True,
              pool_buffers: bool = True) -> tuple[Options, DeviceModel | None, Path | None]:
    """``compile``'s keywords checked: the options, the model, the disk-cache directory."""
    if not isinstance(optimize, str) or optimize not in OPTIMIZE_CHOICES:
        raise OptionError(f"optimize={optimize!r}; choose one of {', '.join(OPTIMIZE_CHOICES)}.")
    if model is not None and not isinstance(model, DeviceModel):
        raise OptionError(
            f"model={model!r} ({type(model).__name__}); pass a tncomp.DeviceModel (e.g. "
            "tncomp.runtime.calibrate.calibrate('cuda')) or None for the device's calibrated "
            "default."
        )
    return (Options(optimize, bool(autotune), bool(cuda_graphs), bool(pool_buffers)), model,
            _disk_directory(disk_cache))


def _disk_directory(disk_cache: bool | str | os.PathLike | None) -> Path | None:
    """The directory of the on-disk cache ``disk_cache`` asks for, or None for no disk cache."""
    if disk_cache is True:
        return default_cache_dir()
    if disk_cache is False or disk_cache is None:
        return None
    if isinstance(disk_cache, str | os.PathLike):
        directory = os.fspath(disk_cache)
        if isinstance(directory, str) and directory.strip():
            return Path(directory)
    raise OptionError(
        f"disk_cache={disk_cache!r} ({type(disk_cache).__name__}); pass True (the default "
        "directory), False (no disk cache) or a directory as a str or pathlib.Path."
    )


def _disk(directory: Path | None) -> DiskCache | None:
    return DiskCache(directory) if directory is not None else None


_EQ_CACHE = LRUCache(maxsize=128)


def contract(eq: str, *tensors: torch.Tensor, **options) -> torch.Tensor:
    """``torch.einsum`` through tncomp: planned, cached, with a planned backward.

    ``options`` are ``compile``'s keywords (``optimize``, ``model``, ``disk_cache``, ...).
    """
    from tncomp.compiler.builders import from_eq

    if not isinstance(eq, str):
        raise IRError(f"eq must be a str such as 'bi,ij->bj', got {eq!r} "
                      f"({type(eq).__name__}).")
    _check_tensors(tensors, "contract")
    unknown = sorted(set(options) - set(_COMPILE_KEYWORDS))
    if unknown:
        raise OptionError(f"contract got unknown option {unknown[0]!r}; its options are "
                          f"compile's: {', '.join(_COMPILE_KEYWORDS)}.")
    settings, model, directory = _settings(**options)
    shapes = tuple(tuple(t.shape) for t in tensors)
    compiled = _EQ_CACHE.get_or_build(
        (eq, shapes, settings, model, directory),
        lambda: CompiledNetwork(from_eq(eq, *shapes), settings, model, _disk(directory)),
    )
    return compiled(*tensors)


_COMPILE_KEYWORDS = ("optimize", "autotune", "cuda_graphs", "model", "disk_cache",
                     "pool_buffers")
