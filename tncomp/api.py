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
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from tncomp.compiler.cache import DiskCache, LRUCache, default_cache_dir
from tncomp.compiler.device_model import CPU_DEFAULT, CUDA_DEFAULT, DeviceModel
from tncomp.compiler.ir import Network, bind_sizes
from tncomp.compiler.memory import check_memory, memory_limit_setting
from tncomp.compiler.plan import Plan
from tncomp.compiler.planner import OPTIMIZE_CHOICES, Options, Planner, binding_key
from tncomp.compiler.problem import Tree
from tncomp.compiler.regimes import RegimeTable
from tncomp.errors import DtypeError, IRError, OperandError, OptionError, TncompError
from tncomp.runtime.autograd import ContractFunction, Runner
from tncomp.runtime.codegen import generate
from tncomp.runtime.library import (
    autocast_operands,
    check_dtype,
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

# The hot path's checks, bound once (dynamo recognises the functions themselves).
_autocast_on = torch._C._is_any_autocast_enabled
_transforms_on = torch._C._are_functorch_transforms_active
_compiling = torch.compiler.is_compiling

MEMORY_FRACTION = 0.5  # the default memory limit of a plan: this share of the device's memory
_RUNNERS = LRUCache(maxsize=512)  # process-wide: identical networks share plans
_LIVE: weakref.WeakSet = weakref.WeakSet()  # compiled networks, so clear_cache reaches them


def clear_cache(disk: bool = False, calibration: bool = False) -> None:
    """Drop every in-memory plan and pooled buffer, in the shared cache and in every live
    compiled network; with ``disk=True`` also the on-disk search results, and with
    ``calibration=True`` the device calibrations in the cache folder (``tncomp cache clear``
    does both; they are removed unread, so a malformed file goes too)."""
    for compiled in list(_LIVE):
        compiled.clear()
    _RUNNERS.clear()
    _FAST.clear()
    if disk:
        DiskCache().clear()
    if calibration:
        from tncomp.runtime.device_timing import remove_calibrations

        remove_calibrations()


def cache_info() -> dict:
    """Counters of the in-memory plan cache, the disk cache location and its entries, and the
    calibration files there."""
    from tncomp.runtime.device_timing import calibration_files

    disk = DiskCache()
    names = [p.name for p in calibration_files(disk.directory)]
    return {"plans": len(_RUNNERS), "hits": _RUNNERS.hits, "misses": _RUNNERS.misses,
            "maxsize": _RUNNERS.maxsize, "disk_dir": str(disk.directory),
            "disk_entries": len(disk.entries()), "calibrations": ", ".join(names) or "none"}


def model_for(device: torch.device | str, calibrated: bool = True) -> DeviceModel:
    """The calibrated model of ``device`` if one was measured, else a default; with
    ``calibrated=False`` the default without reading the cache folder (what
    ``compile(..., disk_cache=False)`` plans with)."""
    from tncomp.runtime.device_timing import load_calibration

    device = torch.device(device)
    measured = load_calibration(device) if calibrated else None
    if measured is not None:
        return measured
    return CUDA_DEFAULT if device.type == "cuda" else CPU_DEFAULT


class CompiledNetwork:
    """A network compiled into ``(*operands) -> output``, differentiable w.r.t. every operand.

    The public face: it checks operands, keeps this network's runners by binding, and hands
    planning (trees, plans, regime tables, every cache key) to its
    :class:`~tncomp.compiler.planner.Planner`."""

    def __init__(self, net: Network, options: Options, model: DeviceModel | None,
                 disk_cache: DiskCache | None):
        self.network = net
        self.options = options
        self._model = model
        self._disk = disk_cache
        self._planner = Planner(net, options, disk_cache)
        self._local: dict = {}
        self._graphs = None  # CapturedGraphs, made on the first CUDA-graph call
        self.op_id = register(self)
        """How the ``tncomp::`` torch operators refer to this network (a string key of
        :func:`tncomp.runtime.library.lookup`; operators take strings, not Python objects)."""
        _LIVE.add(self)

    @property
    def captures(self) -> int:
        """CUDA-graph captures made (tests check that replays do not re-capture)."""
        return self._graphs.captures if self._graphs is not None else 0

    def clear(self) -> None:
        """Forget this network's plans, regime tables, graphs and pooled buffers."""
        for runner in self._local.values():
            for pool in runner.code.pools.values():
                pool.clear()
        self._local.clear()
        self._planner.clear()
        if self._graphs is not None:
            self._graphs.clear()

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
            runner = self.runner_for(operands, grad)
        if self.options.cuda_graphs and operands[0].is_cuda:
            return self._graphed_call(runner, operands)
        if grad and runner.plan.needs_grad.count(True):
            return ContractFunction.apply(runner, *operands)
        return runner.code.forward(*operands)[0]

    def plan_of(self, *operands: torch.Tensor) -> Plan:
        """The plan a call with these operands runs (built and cached now if it is new)."""
        _check_tensors(operands, "plan_of", [t.name for t in self.network.operands])
        grad = torch.is_grad_enabled()
        runner = self._local.get(binding_key(operands, grad))
        return (runner if runner is not None else self.runner_for(operands, grad)).plan

    # -- building -----------------------------------------------------------------------------
    def runner_for(self, operands: Sequence[torch.Tensor], grad: bool,
                   needs_grad: Sequence[bool] | None = None) -> Runner:
        """The runner (plan and generated code) of this binding, built and cached on first use.

        The binding is the operands' shapes, dtype and device and which operands need gradients:
        ``grad and t.requires_grad`` per operand, unless ``needs_grad`` gives the flags (the
        ``tncomp::`` operators pass them explicitly). The call paths outside the eager hot path
        (torch.compile operators, torch.func transforms) run plans through this."""
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
        model = self.model(device)
        memory_key = self._planner.memory_key(sizes, str(dtype), str(device), needs_grad, model)

        def build() -> Runner:
            plan = self.plan_for(sizes, needs_grad, dtype, device, model=model)
            shapes = [tuple(t.shape) for t in operands]
            return Runner(plan, generate(plan, shapes, dtype, device, name=self.network.output.name,
                                         pool=self.options.pool_buffers), shapes, dtype, device)

        runner = _RUNNERS.get_or_build(memory_key, build,
                                       label=f"B={self._planner.bound(sizes)}")
        if len(self._local) > 64:
            self._local.clear()
        self._local[key] = runner
        return runner

    def model(self, device: torch.device | str) -> DeviceModel:
        """The device model that scores plans: the one given to ``compile``, else ``device``'s
        calibrated (or default) model; without a disk cache (``disk_cache=False``) the
        default, for nothing in the cache folder is read then."""
        if self._model is not None:
            return self._model
        return model_for(device, calibrated=self._disk is not None)

    def plan_for(self, sizes: dict[str, int], needs_grad: Sequence[bool],
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", model: DeviceModel | None = None) -> Plan:
        """The plan used at these bound sizes (searching, or reading the regime table), under
        ``model`` (default: the compiled network's model, else the device's)."""
        device = torch.device(device)
        model = model if model is not None else self.model(device)
        timer = orient = None
        if self.options.autotune:
            from tncomp.runtime.autotune import orient_gemms, time_plans

            timer = partial(time_plans, dtype=dtype, device=device)
            orient = partial(orient_gemms, dtype=dtype, device=device)
        # autotuned choices hold for the thread count they were timed at (CPU BLAS orientation
        # and tree speeds change with it): it is part of the autotune key
        where = f"cpu/{torch.get_num_threads()}" if device.type == "cpu" else device.type
        return self._planner.plan_for(sizes, needs_grad, dtype.itemsize, model,
                                      dtype_name=str(dtype), device_type=where,
                                      timer=timer, orient=orient,
                                      memory_limit=self.memory_limit(device))

    def memory_limit(self, device: torch.device | str) -> int | None:
        """The most bytes a plan on ``device`` may hold at once (:attr:`Plan.peak_bytes`):
        ``compile``'s ``memory_limit``, else ``$TNCOMP_MEMORY_LIMIT`` (read at compile time),
        else :data:`MEMORY_FRACTION` of the device's memory (None when unknown: no limit)."""
        if self.options.memory_limit is not None:
            return self.options.memory_limit
        from tncomp.runtime.device_timing import device_memory

        total = device_memory(device)
        return None if total is None else int(MEMORY_FRACTION * total)

    def tree_for(self, sizes: Mapping[str, int], needs_grad: Sequence[bool], itemsize: int,
                 model: DeviceModel) -> Tree:
        """The contraction tree used at these bound sizes: read from the batch regime table
        (``optimize="auto"``, one symbolic size), else searched (least modelled time, or fewest
        FLOPs for ``"flops"``) and kept in the disk cache when there is one."""
        return self._planner.tree_for(sizes, needs_grad, itemsize, model)

    def regimes(self, needs_grad: Sequence[bool] | None = None, itemsize: int = 4,
                model: DeviceModel | None = None) -> RegimeTable:
        """The batch-size regimes of a network with one symbolic size (built once, cached)."""
        if len(self.network.dims) == 1 and model is None:
            model = self.model(torch.device("cpu"))
        return self._planner.regimes(needs_grad, itemsize, model)

    def with_memory(self, memory: str | int) -> CompiledNetwork:
        """This network compiled with the same options and model under another memory mode
        (``self`` when it is the same)."""
        memory = check_memory(memory)
        if memory == self.options.memory:
            return self
        return CompiledNetwork(self.network, replace(self.options, memory=memory), self._model,
                               self._disk)

    def _graphed_call(self, runner: Runner, operands):
        from tncomp.runtime.cudagraph import CapturedGraphs, graphed_call

        if self._graphs is None:
            self._graphs = CapturedGraphs()
        return graphed_call(self._graphs, runner, operands)

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
    memory: str | int = "fast",
    memory_limit: int | None = None,
) -> CompiledNetwork:
    """Compile ``net`` into a callable ``(*operands) -> output`` with a planned backward pass.

    optimize: ``"auto"`` (batch regimes for one symbolic size, else a search per binding),
    ``"search"`` (always search the bound sizes), or ``"flops"`` (fewest FLOPs, ignoring the
    device model). ``autotune`` times the best few candidates on the device and keeps the
    fastest. ``cuda_graphs`` captures forward and backward into CUDA graphs on a GPU (ignored
    on CPU). ``model``: the :class:`DeviceModel` plans are scored with (default: the device's
    calibration, else a default). ``disk_cache``: True (the default directory), False or None,
    or a directory. With False (or None) nothing in the cache folder is read, the calibration
    included: plans are scored with the given ``model``, else the device's default model. With
    a directory, search results are kept there and the calibration is read from the default
    folder (``tncomp calibrate`` writes it there). ``pool_buffers`` reuses large result
    buffers between calls once nothing references them (a caching allocator;
    ``tncomp.clear_cache()`` releases them).
    ``memory`` trades time for the memory the forward keeps for the backward: ``"fast"`` saves
    every intermediate the backward reads, ``"min"`` none (the backward recomputes them from
    the operands), ``"balanced"`` drops the saves whose recomputation costs little modelled
    time (at most 10% more in all), and an int is a budget in bytes for the saved
    intermediates at each binding (``"min"`` is the floor). See ``Plan.saved_bytes``.
    ``memory_limit``: the most bytes a plan may hold at once (``Plan.peak_bytes``: its
    intermediates, output and gradients); default ``$TNCOMP_MEMORY_LIMIT``, else half of the
    device's memory. A binding whose every plan needs more (after trying ``memory="min"``)
    raises :class:`~tncomp.errors.MemoryLimitError` before anything is allocated.
    """
    if not isinstance(net, Network):
        raise TncompError(
            f"compile takes a tncomp.Network (from tt_linear, from_eq, ...), got "
            f"{type(net).__name__}."
        )
    options, model, directory = _settings(optimize, autotune, cuda_graphs, model, disk_cache,
                                          pool_buffers, memory, memory_limit)
    return CompiledNetwork(net, options, model, _disk(directory))


def _settings(optimize: str = "auto", autotune: bool = False, cuda_graphs: bool = False,
              model: DeviceModel | None = None, disk_cache: bool | str | os.PathLike = True,
              pool_buffers: bool = True, memory: str | int = "fast",
              memory_limit: int | None = None,
              ) -> tuple[Options, DeviceModel | None, Path | None]:
    """``compile``'s keywords checked: the options, the model, the disk-cache directory."""
    if not isinstance(optimize, str) or optimize not in OPTIMIZE_CHOICES:
        raise OptionError(f"optimize={optimize!r}; choose one of {', '.join(OPTIMIZE_CHOICES)}.")
    if model is not None and not isinstance(model, DeviceModel):
        raise OptionError(
            f"model={model!r} ({type(model).__name__}); pass a tncomp.DeviceModel (e.g. "
            "tncomp.runtime.device_timing.calibrate('cuda')) or None for the device's calibrated "
            "default."
        )
    memory = check_memory(memory)
    limit = memory_limit_setting(memory_limit, os.environ)
    return (Options(optimize, bool(autotune), bool(cuda_graphs), bool(pool_buffers), memory,
                    limit), model, _disk_directory(disk_cache))


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
# contract's per-call lookup with the default options: (eq, shapes, $TNCOMP_CACHE_DIR, which
# picks the disk folder) -> (diagonal steps or None, compiled network); bounded, and emptied
# by clear_cache.
_FAST: dict = {}
_FAST_MAX = 256
_CACHE_ENV = "TNCOMP_CACHE_DIR"
_environ = os.environ


def contract(eq: str | torch.Tensor, *tensors: Any, **options: Any) -> torch.Tensor:
    """``torch.einsum`` through tncomp: planned, cached, with a planned backward.

    Takes what ``torch.einsum`` takes: an equation and its operands (or one list of them), or
    the sublist form ``contract(a, [0, 1], b, [1, 2], [0, 2])`` (ints in [0, 52) and
    ``...``); implicit outputs, ``...`` broadcasting (size-1 axes broadcast), letters repeated
    within one operand (diagonals and traces such as ``'aab,bcc->ac'``: the diagonal is a
    strided view taken before planning, so the planner sees distinct indices), and axes of size
    0 (einsum's empty or zero result, and zero gradients). ``options`` are ``compile``'s
    keywords (``optimize``, ``model``, ``disk_cache``, ...). Errors name shapes and dtypes,
    never tensor values.
    """
    key = None
    if not options and type(eq) is str:  # the hot path: a call seen before, default options
        try:
            key = (eq, tuple([t.shape for t in tensors]), _environ.get(_CACHE_ENV))
            hit = _FAST.get(key)
        except (AttributeError, TypeError):  # not tensors: the checks below say so
            key = hit = None
        if hit is not None:
            diagonals, compiled = hit
            if diagonals is not None:
                tensors = _diagonal_views(tensors, diagonals)
            return compiled(*tensors)
    eq, tensors = _einsum_form(eq, tensors)
    _check_tensors(tensors, "contract")
    unknown = sorted(set(options) - set(_COMPILE_KEYWORDS))
    if unknown:
        raise OptionError(f"contract got unknown option {unknown[0]!r}; its options are "
                          f"compile's: {', '.join(_COMPILE_KEYWORDS)}.")
    settings, model, directory = _settings(**options)
    shapes = tuple(tuple(t.shape) for t in tensors)
    if is_empty(tensors):
        return _empty_contract(eq, tensors, shapes)

    def build() -> tuple[tuple, CompiledNetwork]:
        from tncomp.compiler.einsum import parse_eq

        parsed = parse_eq(eq, *shapes)
        compiled = CompiledNetwork(parsed.network(), settings, model, _disk(directory))
        return (parsed.diagonals if any(parsed.diagonals) else None), compiled

    diagonals, compiled = _EQ_CACHE.get_or_build((eq, shapes, settings, model, directory), build)
    if key is not None:
        if len(_FAST) >= _FAST_MAX:
            _FAST.clear()
        _FAST[key] = (diagonals, compiled)
    if diagonals is not None:
        tensors = _diagonal_views(tensors, diagonals)
    return compiled(*tensors)


def _diagonal_views(tensors, diagonals) -> tuple:
    views = []
    for t, steps in zip(tensors, diagonals, strict=True):
        for dim1, dim2 in steps:  # each call appends the diagonal as the last axis
            t = t.diagonal(0, dim1, dim2)
        views.append(t)
    return tuple(views)


def _describe(value: object) -> str:
    """A value as an error message shows it: a tensor by shape and dtype, never its values."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({type(value).__name__})"


def _einsum_form(eq, tensors: tuple) -> tuple[str, tuple]:
    """``(eq, tensors)`` of any form ``torch.einsum`` takes: an equation with operands or one
    list of them, or the sublist form (operands and lists of ints in [0, 52) or ``...``)."""
    if isinstance(eq, torch.Tensor):
        return _from_sublists((eq, *tensors))
    if not isinstance(eq, str):
        raise IRError(f"eq must be a str such as 'bi,ij->bj' (or an operand, for the sublist "
                      f"form), got {_describe(eq)}.")
    if len(tensors) == 1 and isinstance(tensors[0], list | tuple):
        tensors = tuple(tensors[0])
    return eq, tuple(tensors)


def _letter(number: object, where: str) -> str:
    """torch.einsum's letter for a sublist entry: 0-25 -> A-Z, 26-51 -> a-z, ... -> '...'."""
    if number is Ellipsis:
        return "..."
    if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number < 52:
        raise IRError(f"{where} holds {_describe(number)}; sublist entries are ints in [0, 52) "
                      "or ... (Ellipsis), e.g. contract(a, [0, 1], b, [1, 2], [0, 2]).")
    return chr(ord("A") + number) if number < 26 else chr(ord("a") + number - 26)


def _from_sublists(args: tuple) -> tuple[str, tuple]:
    """The equation and operands of ``contract(a, [0, 1], b, [1, 2][, [0, 2]])``."""
    operands, terms = args[0::2], args[1::2]
    output = None
    if len(operands) > len(terms):  # an odd count: the last item is the output sublist
        *operands, output = operands
    for k, (t, term) in enumerate(zip(operands, terms, strict=True)):
        if not isinstance(t, torch.Tensor):
            raise OperandError(f"contract's sublist form takes operand, sublist, operand, ...; "
                               f"item {2 * k} is {_describe(t)}, not a tensor.")
        if not isinstance(term, list | tuple):
            raise IRError(f"contract's sublist form takes operand, sublist, operand, ...; item "
                          f"{2 * k + 1} is {_describe(term)}, not a list such as [0, 1].")
    if output is not None and not isinstance(output, list | tuple):
        raise IRError(f"the output sublist (the last argument) is {_describe(output)}; pass a "
                      "list such as [0, 2], or leave it out for einsum's implicit output.")
    lhs = ",".join("".join(_letter(v, f"the sublist of operand {k}") for v in term)
                   for k, term in enumerate(terms))
    eq = lhs if output is None else lhs + "->" + "".join(
        _letter(v, "the output sublist") for v in output)
    return eq, tuple(operands)


def _empty_contract(eq: str, tensors: tuple, shapes: tuple) -> torch.Tensor:
    """``torch.einsum``'s empty (or zero) result for operands with an axis of size 0, after the
    checks a contraction makes: the equation against the shapes, one floating dtype, one
    device. Differentiable: the gradients are zeros (or empty)."""
    from tncomp.compiler.einsum import parse_eq

    parse_eq(eq, *shapes)
    dtype, device = tensors[0].dtype, tensors[0].device
    for k, t in enumerate(tensors):
        if t.dtype != dtype or t.device != device:
            raise DtypeError(f"operand {k} is {t.dtype} on {t.device} but operand 0 is {dtype} "
                             f"on {device}; pass all operands with one dtype and device.")
    check_dtype(dtype, device)
    return torch.einsum(eq, *tensors)


_COMPILE_KEYWORDS = ("optimize", "autotune", "cuda_graphs", "model", "disk_cache",
                     "pool_buffers", "memory", "memory_limit")
