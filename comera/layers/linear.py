"""Linear layers of any registered weight format, with diagonal rank gates, on tncomp plans.

A layer holds a format (:mod:`comera.formats.registry`) and its layout
(:class:`~comera.formats.layout.Layout`): the cores, and the bonds that carry a gate vector d_k
each (initialised to 1); entries with |d_k| <= tau count as zero: they scale their rank slice to
zero and receive no gradient. Gate k folds into the first core that carries bond k, along that
axis. The gated cores are passed to the format's compiled tncomp network, so the forward and
backward contractions are planned (no hand-written per-format code here).

``GatedLinear(in, out, format="tucker", ...)`` is the layer for any format; ``TTLinear`` (the
CoMERA TT format: 2d cores (r_{k-1}, n_k, r_k) over ``in_modes + out_modes``) and ``TTMLinear``
(the interleaved TT-matrix format: d cores (r_{k-1}, m_k, n_k, r_k)) are it at "tt" and "ttm".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

import tncomp
from comera.errors import ConfigError, ConversionError, NonFiniteError, tncomp_errors_as_config
from comera.formats.bond_ranks import warn_full_rank
from comera.formats.einsum import layout_from_eq
from comera.formats.factorize import factorize, factorize_pair
from comera.formats.layout import Layout
from comera.formats.registry import Format, get_format
from comera.formats.scaling import (
    DECOMPOSED,
    FRESH,
    balance_gauge,
    check_parametrization,
    core_scaling,
    orthogonal_cores,
)
from comera.numbers import is_int
from tncomp.extend import autocast_cast, autocast_dtype, check_modes, renamed
from tncomp.extend import check_memory as _check_tncomp_memory

__all__ = ["DECOMPOSED_FORMAT", "DEFAULT_TAU", "FRESH_FORMAT", "GatedLayer", "GatedLinear",
           "TTLinear", "TTMLinear", "load_cores_"]

DEFAULT_TAU = 1e-2
#: The format of a gated layer built fresh and trained from scratch: ``GatedLinear(in, out)``,
#: ``EngineConfig.format``, the LM and masked-LM tasks (``comera train lm|mlm``). TT-matrix,
#: chosen by the measurements: it trains like dense where TT does not (docs/formats.md,
#: "Choosing a format").
FRESH_FORMAT = "ttm"
#: The format of a layer decomposed from trained weights (``GatedLinear.from_linear``): TT,
#: CoMERA's format; conversions keep their own measured default.
DECOMPOSED_FORMAT = "tt"
Ranks = int | Sequence[int]


def check_features(name: str, value: int) -> int:
    """``value`` as a feature size (an int >= 1), else :class:`ConfigError` naming it."""
    if not is_int(value):
        raise ConfigError(f"{name}={value!r}; a feature size is an int >= 1.")
    return value


def _check_modes(modes, features: int, what: str) -> tuple[int, ...]:
    with tncomp_errors_as_config():
        modes = check_modes(modes, what)  # tncomp's one check of modes
    if math.prod(modes) != features:
        raise ConfigError(
            f"{what} {modes} multiply to {math.prod(modes)}, not {features}; choose modes whose "
            f"product is {features} (or leave them out to factorize automatically)."
        )
    return modes


def resolve_modes(in_features: int, out_features: int, in_modes, out_modes, d: int):
    """Given modes as they are; a missing side factorized with as many modes as the other."""
    if in_modes is None and out_modes is None:
        return factorize_pair(in_features, out_features, d)
    if in_modes is None:
        in_modes = factorize(in_features, len(tuple(out_modes)))
    if out_modes is None:
        out_modes = factorize(out_features, len(tuple(in_modes)))
    return in_modes, out_modes


def add_bias(y: Tensor, bias: Tensor | None, source: Tensor) -> Tensor:
    """``y + bias`` (``bias`` broadcast over ``y``'s leading axes, in ``y``'s dtype), written into
    ``y`` itself when ``y`` is a contraction result that nothing else references.

    Why: on the CPU an out-of-place add allocates a second output-sized tensor, and torch hands
    large tensors fresh pages each time, which can cost more than the layer's own forward
    (figures in docs/results.md, "Measured rules of the CPU executor"); the second buffer also
    raises the peak by one output. ``nn.Linear`` folds its bias into addmm.
    The sum is the same op in the same order, so results are bit-identical either way.

    Out of place when in-place is not safe or not wanted: under ``torch.compile`` (inductor
    plans its own buffers) and torch.func transforms (a batched bias cannot be added into an
    unbatched result), when ``y`` is a view (autograd forbids in-place on views made inside a
    custom Function), and when ``y`` shares memory with the input ``source``."""
    if bias is None:
        return y
    bias = bias.to(y.dtype)
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return y + bias  # checked first: batched and fake tensors have no storage to compare
    if y._is_view() or y.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
        return y + bias
    return y.add_(bias)


def check_memory(memory) -> str | int:
    """A tncomp memory mode (``"fast"``, ``"balanced"``, ``"min"`` or a byte budget), else a
    :class:`ConfigError` naming the value and the choices."""
    with tncomp_errors_as_config():
        return _check_tncomp_memory(memory)


def check_tau(tau: float) -> float:
    """``tau`` as a gate threshold, a number in [0, 1), else :class:`ConfigError`. Gates start
    at 1, so a threshold at or above 1 would prune every rank of a fresh layer (a record
    edited to ``tau=1e300`` would silently zero its layer)."""
    if isinstance(tau, bool) or not isinstance(tau, int | float) or not 0 <= tau < 1:
        raise ConfigError(f"tau={tau!r}; the gate threshold is a number in [0, 1) (default "
                          "1e-2): gates start at 1, and entries at or below tau are pruned.")
    return float(tau)


def broadcast_along(vector: Tensor, axis: int, ndim: int) -> Tensor:
    """``vector`` shaped to scale axis ``axis`` of an ``ndim``-axis core (as is for the last)."""
    if axis == ndim - 1:
        return vector
    return vector.reshape(vector.shape[0], *(1,) * (ndim - 1 - axis))


class GatedLayer(nn.Module):
    """What every gated layer shares: a format and its layout, cores, one rank gate per bond,
    tau, bias and the compiled plan. Subclasses set ``in_features`` and ``out_features``."""

    in_features: int
    out_features: int

    def __init__(self, layout: Layout, format: Format | str, bias: bool, tau: float,
                 dtype=None, device=None, memory: str | int = "fast"):
        super().__init__()
        self.tau = check_tau(tau)
        self.format = get_format(format)
        if not isinstance(layout, Layout):
            raise ConfigError(f"layout={layout!r}; a gated layer takes a comera Layout (from "
                              "a format's layout(...) or Layout.from_dict).")
        self._layout = layout
        self._adopt_structure_()
        self._layout_shapes = layout.core_shapes  # the core shapes ``_layout`` is for
        factory = {"dtype": dtype, "device": device}
        self.cores = nn.ParameterList(
            [nn.Parameter(torch.empty(shape, **factory)) for shape in layout.core_shapes])
        self.gates = nn.ParameterList(
            [nn.Parameter(torch.ones(size, **factory)) for size in layout.bond_sizes])
        self.bias = nn.Parameter(torch.zeros(layout.out_features, **factory)) if bias else None
        # The forward reads core k as _scales[k] * cores[k] (powers of two). Scales other than
        # one live in the buffer "core_scales" too, so checkpoints carry what their cores mean.
        self._scales = (1.0,) * len(layout.cores)
        self.parametrization = "plain"
        self._register_load_state_dict_pre_hook(_adopt_saved_scales, with_module=True)
        self._compiled_for: tuple | None = None
        self._compiled = None
        # Options for tncomp.compile, e.g. {"cuda_graphs": True} to replay the contraction
        # from a captured CUDA graph, or {"autotune": True}; ``memory`` sets "memory".
        self.compile_options: dict = {}
        if check_memory(memory) != "fast":
            self.compile_options["memory"] = memory

    @property
    def memory(self) -> str | int:
        """What the forward keeps for the backward (tncomp's ``memory`` option): ``"fast"``
        (every intermediate the backward reads), ``"balanced"``, ``"min"`` (only the input and
        the cores: the backward recomputes the rest) or a byte budget. Setting it re-plans."""
        return self.compile_options.get("memory", "fast")

    @memory.setter
    def memory(self, memory: str | int) -> None:
        memory = check_memory(memory)
        options = {k: v for k, v in self.compile_options.items() if k != "memory"}
        self.compile_options = options if memory == "fast" else {**options, "memory": memory}
        self.build_compiled()

    # -- structure ------------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        """The layer's layout at its stored core shapes (followed after truncation, rounding and
        loading: whatever resized the cores, the bonds are read from them)."""
        shapes = tuple(tuple(c.shape) for c in self.cores)
        if shapes != self._layout_shapes:
            sizes = {bond: int(shapes[c][a])
                     for bond, (c, a) in zip(self._layout.bonds, self._folds, strict=True)}
            layout = self._layout.resized(sizes)
            if layout.core_shapes != shapes:
                raise ConfigError(
                    f"{type(self).__name__}: cores of shapes {shapes} do not fit the layout "
                    f"{layout.cores} (every core carrying a bond must give it one size); "
                    "resize layers with resize_bonds_.")
            self._layout, self._layout_shapes = layout, shapes
        return self._layout

    def _adopt_structure_(self) -> None:
        """Read what never changes from the layout: gate k scales axis ``axis`` of core
        ``core`` (the first core that carries bond k), and the feature modes."""
        self._folds = tuple(self._layout.carriers(bond)[0] for bond in self._layout.bonds)
        self._modes = (self._layout.in_modes, self._layout.out_modes)

    @property
    def in_modes(self) -> tuple[int, ...]:
        """The sizes of x's feature indices (``x`` is reshaped to ``(B, *in_modes)``)."""
        return self._modes[0]

    @property
    def out_modes(self) -> tuple[int, ...]:
        """The sizes of y's feature indices."""
        return self._modes[1]

    @property
    def bond_sizes(self) -> tuple[int, ...]:
        """Stored (physical) size of each bond, in gate order."""
        return self.layout.bond_sizes

    @property
    def bond_ranks(self) -> tuple[int, ...]:
        """Effective size of each bond (its gate entries above tau, a NaN counting as alive as
        in :meth:`gate_masks`), in gate order. The gates are read in one test: sizes are
        counted several times a step, and a test per gate costs more than the counting."""
        return bond_ranks_of([self])[0]

    @property
    def bonds(self) -> tuple[int, ...]:
        """Stored bond sizes; a chain's with its ends, ``(1, r_1, ..., r_{n-1}, 1)``."""
        sizes = self.bond_sizes
        return (1, *sizes, 1) if self._layout.is_chain else sizes

    @property
    def ranks(self) -> tuple[int, ...]:
        """Effective bond sizes (gate entries above tau); a chain's with its ends."""
        ranks = self.bond_ranks
        return (1, *ranks, 1) if self._layout.is_chain else ranks

    def gate_masks(self) -> list[Tensor]:
        """Per gate, a bool mask of the rank slices still alive (``|gate| > tau``), detached.
        A NaN entry counts as alive: it still reaches the output, so it is never pruned
        silently (:meth:`check_finite_gates` refuses it where ranks are cut)."""
        return [~(g.detach().abs() <= self.tau) for g in self.gates]

    def effective_gates(self) -> list[Tensor]:
        """Gates with the entries at or below tau zeroed (and cut off from the gradient); a NaN
        entry stays (as in :meth:`gate_masks`)."""
        return [torch.where(g.detach().abs() <= self.tau, 0.0, g) for g in self.gates]

    def check_finite_gates(self, name: str = "") -> None:
        """Raise :class:`NonFiniteError` naming the layer, the gate and the entries when a gate
        holds a NaN or infinite value: pruning or truncating it would change the function the
        layer computes (its output is already NaN)."""
        for k, gate in enumerate(self.gates):
            bad = (~torch.isfinite(gate.detach())).nonzero().flatten().tolist()
            if bad:
                raise NonFiniteError(
                    f"layer {name or type(self).__name__}: gate {k} holds non-finite entries at "
                    f"{bad[:8]}; its output is NaN, so its ranks are not cut. Restore the layer "
                    "from a checkpoint (or lower the learning rates) before truncating.")

    def gate_folds(self) -> tuple[tuple[int, int], ...]:
        """Per gate, the ``(core, axis)`` it folds into: the first core carrying its bond."""
        return self._folds

    def set_core_scales_(self, scales: Sequence[float]) -> None:
        """Make the forward read core k as ``scales[k] * cores[k]`` (the stored values are not
        changed: rescale them yourself to keep the function)."""
        scales = tuple(float(s) for s in scales)
        if len(scales) != len(self.cores) or not all(s > 0 and math.isfinite(s)
                                                     for s in scales):
            raise ConfigError(f"core_scales {scales} for a layer of {len(self.cores)} cores; "
                              "give one finite number > 0 per core.")
        self._scales = scales
        self._buffers.pop("core_scales", None)
        if any(s != 1.0 for s in scales):
            self.register_buffer("core_scales", torch.tensor(
                scales, dtype=torch.float32, device=self.cores[0].device))

    @property
    def core_scale_values(self) -> tuple[float, ...]:
        """The forward multiplier of each stored core (ones: the plain parametrization)."""
        return self._scales

    def effective_cores(self) -> list[Tensor]:
        """The cores as the network reads them: each stored core times its scale (gates not
        folded in)."""
        return [c * s if s != 1.0 else c for c, s in zip(self.cores, self._scales, strict=True)]

    def gated_cores(self) -> list[Tensor]:
        """Effective cores (:meth:`effective_cores`) with each gate folded into the first core
        that carries its bond (for a chain: the right bond of the core before it)."""
        # A power-of-two scale (as the parametrizations set) rides on the core's first gate:
        # a product over a vector instead of over the core, with the same values.
        rides = [s != 1.0 and math.frexp(s)[0] == 0.5 for s in self._scales]
        out = [c * s if s != 1.0 and not ride else c
               for c, s, ride in zip(self.cores, self._scales, rides, strict=True)]
        for gate, (c, axis) in zip(self.effective_gates(), self._folds, strict=True):
            if rides[c]:
                gate, rides[c] = gate * self._scales[c], False
            out[c] = out[c] * broadcast_along(gate, axis, out[c].dim())
        return [c * s if ride else c
                for c, s, ride in zip(out, self._scales, rides, strict=True)]

    def is_removed(self) -> bool:
        """True when some gate is entirely zero: the weight is then exactly zero (every term
        of the network sums over that bond)."""
        return 0 in self.bond_ranks

    def num_parameters(self, effective: bool = True) -> int:
        """Parameters of the layer. ``effective``: cores at the effective ranks (gates fold into
        the cores), zero for a removed layer, plus the bias. Otherwise: every stored parameter."""
        if not effective:
            return sum(p.numel() for p in self.parameters())
        return self.parameters_at_ranks(self.bond_ranks)

    def parameters_at_ranks(self, ranks: Sequence[int]) -> int:
        """Parameters of the layer with its bonds at ``ranks`` (gate order; zero for a removed
        layer, plus the bias): :meth:`num_parameters` at given effective ranks."""
        bias = self.bias.numel() if self.bias is not None else 0
        if 0 in ranks:  # removed (is_removed): the weight is exactly zero
            return bias
        return bias + self.layout.parameters_at(tuple(ranks))

    def dense_num_parameters(self) -> int:
        """Parameters of the equivalent dense layer: ``in_features * out_features`` + bias."""
        return self.in_features * self.out_features + (
            self.bias.numel() if self.bias is not None else 0)

    def resize_bonds_(self, bond_sizes: Sequence[int]) -> None:
        """Give the layer cores and gates of ``bond_sizes`` (gate order): new uninitialised
        Parameters where a shape differs (load the weights next), gates of ones."""
        layout = self._layout.resized(dict(zip(self._layout.bonds, (int(b) for b in bond_sizes),
                                               strict=True)))
        for k, (old, shape) in enumerate(zip(self.cores, layout.core_shapes, strict=True)):
            if tuple(old.shape) != shape:
                self.cores[k] = nn.Parameter(old.new_empty(shape),
                                             requires_grad=old.requires_grad)
        for k, (gate, size) in enumerate(zip(self.gates, layout.bond_sizes, strict=True)):
            if gate.numel() != size:
                self.gates[k] = nn.Parameter(gate.new_ones(size),
                                             requires_grad=gate.requires_grad)
        self._layout, self._layout_shapes = layout, layout.core_shapes
        self.build_compiled()

    # -- compute --------------------------------------------------------------------------------
    def _network(self) -> tncomp.Network:
        return self.format.network(self.layout)

    def _structure(self) -> tuple:
        """Whatever besides the core shapes decides the network (part of the plan key)."""
        return ()

    def plan_key(self) -> tuple:
        """What decides the layer's compiled networks: core shapes, structure, compile options
        (the one key of every plan a gated layer holds)."""
        return (tuple(tuple(c.shape) for c in self.cores), self._structure(),
                tuple(sorted(self.compile_options.items())))

    def compiled(self) -> tncomp.CompiledNetwork:
        """The compiled contraction for the current core shapes (re-planned after truncation)."""
        key = self.plan_key()
        if self._compiled is None or self._compiled_for != key:
            self._compiled = tncomp.compile(self._network(), **self.compile_options)
            self._compiled_for = key
        return self._compiled

    def forward(self, x: Tensor) -> Tensor:
        """``x @ W + bias`` for ``x`` of shape ``(..., in_features)``, contracted through the gated
        cores without forming W: a tensor of shape ``(..., out_features)``."""
        if not isinstance(x, Tensor) or x.dim() == 0:
            raise ConfigError(
                f"{type(self).__name__} takes a tensor of shape (..., {self.in_features}), got "
                f"{'a 0-dim tensor' if isinstance(x, Tensor) else type(x).__name__}; add the "
                "feature axis, e.g. x.reshape(1, -1).")
        if x.shape[-1] != self.in_features:
            raise ConfigError(
                f"{type(self).__name__} expects inputs whose last axis has {self.in_features} "
                f"features, got shape {tuple(x.shape)}."
            )
        lead = x.shape[:-1]
        rows = math.prod(lead)
        low = autocast_dtype(x.device.type)
        if x.device != self.cores[0].device:
            raise ConfigError(
                f"{type(self).__name__}: the input is on {x.device}, the cores on "
                f"{self.cores[0].device}; move one to the other, e.g. x.to("
                f"'{self.cores[0].device}').")
        if rows == 0 or x.device.type == "meta":  # meta: shapes only, there is nothing to add
            y = autocast_cast(x, low).new_zeros(*lead, self.out_features) if low else \
                x.new_zeros(*lead, self.out_features)
            # as nn.Linear: an empty batch gives the parameters zero gradients, not none
            y = y + sum(p.reshape(-1)[:0].sum() for p in (*self.cores, *self.gates)).to(y.dtype)
        else:
            xm = x.reshape(rows, *self.in_modes)
            cores = self.gated_cores()
            if low is not None:  # as nn.Linear: compute in the autocast dtype, keep params as is
                xm, cores = autocast_cast(xm, low), [autocast_cast(c, low) for c in cores]
            y = self.compiled()(xm, *cores)  # (rows, *out_modes)
            bias = None if self.bias is None else self.bias.view(self.out_modes)
            return add_bias(y, bias, xm).reshape(*lead, self.out_features)
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def build_compiled(self) -> None:
        """Build the compiled networks of the current core shapes now. Layers call it whenever
        their shapes change (construction, loading, truncation, unpickling), so a forward traced
        by ``torch.compile`` only looks them up: creating one inside a trace breaks the graph."""
        self.compiled()

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        if "_layout" not in self.__dict__:  # pickled before layers had a layout: a TT chain
            self._adopt_chain_layout_()
        if "_scales" not in self.__dict__:  # pickled before the parametrizations: plain
            self._scales = (1.0,) * len(self.cores)
            self.parametrization = "plain"
            self._register_load_state_dict_pre_hook(_adopt_saved_scales, with_module=True)
        self.build_compiled()

    def _adopt_chain_layout_(self) -> None:
        """Give a layer unpickled from before formats (TTLinear: "tt"; TTMLinear and
        TTEmbedding: "ttm") its format and the chain layout of its stored cores."""
        fmt = get_format(getattr(self, "fixed_format", None) or "ttm")
        in_modes, out_modes = self.__dict__.pop("in_modes"), self.__dict__.pop("out_modes")
        layout = fmt.layout(tuple(in_modes), tuple(out_modes), 1)
        sizes = [int(c.shape[-1]) for c in self.cores][:-1]
        self._layout = layout.resized(dict(zip(layout.bonds, sizes, strict=True)))
        self._layout_shapes = self._layout.core_shapes
        self.format = fmt
        self._adopt_structure_()

    def __getstate__(self):  # compiled plans hold generated code: rebuild after unpickling
        state = self.__dict__.copy()
        state["_compiled"] = None
        state["_compiled_for"] = None
        return state

    def reset_cores_(self) -> None:
        """Draw the cores anew as the layer's parametrization initialises them (balanced:
        semi-orthogonal cores at their fan-in scales; plain: one Gaussian scale), gates of one,
        bias zero. Cores on the meta device hold no values: nothing to draw."""
        if self.parametrization == "plain":
            self._gaussian_init_()
            return
        if self.cores[0].is_meta:
            return
        layout = self.layout
        self._start_from_(orthogonal_cores(layout, core_scaling(layout),
                                           dtype=self.cores[0].dtype,
                                           device=self.cores[0].device))

    def _start_from_(self, cores: list[Tensor]) -> None:
        """Start the layer from the unscaled ``cores`` (each divided by its scale multiplier),
        every gate open and the bias zero: how every fresh initialisation ends."""
        with torch.no_grad():
            for core, value, scale in zip(self.cores, cores, self._scales, strict=True):
                core.copy_(value / scale)
            for gate in self.gates:
                gate.fill_(1.0)
            if self.bias is not None:
                self.bias.zero_()

    def _gaussian_init_(self) -> None:
        """Gaussian cores scaled so the dense weight has variance about 1/(fan_in + fan_out):
        std = (target / prod of the internal index sizes) ** (1 / (2 * cores)). Cores on the
        meta device hold no values: nothing to draw."""
        if self.cores[0].is_meta:
            return
        layout = self.layout
        target = 1.0 / (self.in_features + self.out_features)
        internal = math.prod(layout.size(i) for i in layout.internal)
        std = (target / internal) ** (1.0 / (2 * len(self.cores)))
        with torch.no_grad():
            for core in self.cores:
                core.normal_(0.0, std)
            for gate in self.gates:
                gate.fill_(1.0)
            if self.bias is not None:
                self.bias.zero_()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"in_modes={self.in_modes}, out_modes={self.out_modes}, ranks={self.ranks}, "
                f"bias={self.bias is not None}, tau={self.tau}, "
                f"parametrization={self.parametrization!r}")


def bond_ranks_of(layers: Sequence[GatedLayer]) -> list[tuple[int, ...]]:
    """Each layer's :attr:`~GatedLayer.bond_ranks`, the gates of every layer on one device
    and with one tau tested and read back at once: one transfer per group, where a layer at a
    time costs a transfer (on a GPU, a sync) per layer."""
    alive: dict[tuple[int, int], list[bool]] = {}  # (layer, gate) -> its entries alive
    groups: dict[tuple[str, float], list[tuple[int, int]]] = {}
    for i, layer in enumerate(layers):
        for j, g in enumerate(layer.gates):
            groups.setdefault((str(g.device), layer.tau), []).append((i, j))
    for (_, tau), members in groups.items():
        gates = [layers[i].gates[j].detach().reshape(-1) for i, j in members]
        flags = (~(torch.cat(gates).abs() <= tau)).tolist()  # a NaN counts as alive
        start = 0
        for key, g in zip(members, gates, strict=True):
            alive[key] = flags[start:start + g.numel()]
            start += g.numel()
    return [tuple(sum(alive[i, j]) for j in range(len(layer.gates)))
            for i, layer in enumerate(layers)]


def _adopt_saved_scales(module: GatedLayer, state_dict, prefix, local_metadata, strict,
                        missing_keys, unexpected_keys, error_msgs) -> None:
    """Loading a state dict: the layer takes the saved cores' scales with them (ones when the
    state dict predates the parametrizations), so the loaded weight is exactly the saved one."""
    saved = state_dict.get(prefix + "core_scales")
    if saved is None:  # plain cores (or a state dict from before the parametrizations)
        scales = (1.0,) * len(module.cores)
    elif saved.dim() != 1 or saved.numel() != len(module.cores):
        return  # load_state_dict reports the mismatch
    else:
        scales = tuple(float(v) for v in saved.tolist())
        if not all(s > 0 and math.isfinite(s) for s in scales):
            raise ConfigError(f"{prefix}core_scales holds {list(scales)}; a core's scale is a "
                              "finite number > 0 (the state dict is damaged).")
    module.set_core_scales_(scales)
    if all(s == 1.0 for s in scales):
        module.parametrization = "plain"
    elif module.parametrization == "plain":  # scaled cores: re-drawing or loading must see them
        module.parametrization = "balanced"


#: ``GatedTrain``, the name of :class:`GatedLayer` before every format shared it: warned
#: until 0.3.0.
__getattr__ = renamed(__name__, {"GatedTrain": (f"{__name__}:GatedLayer", "0.3.0")})


def check_finite_weight(module: nn.Module, weight: Tensor, bias: Tensor | None = None) -> None:
    """Refuse to factorise a dense ``module`` whose weight (or bias) holds NaN or infinite
    entries: :class:`ConversionError` naming the module and the count (an SVD of it fails
    or yields NaN cores)."""
    for what, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        bad = int((~torch.isfinite(t.detach())).sum())
        if bad:
            raise ConversionError(
                f"{module} has {bad} NaN or infinite {what} entries; it cannot be factorised. "
                "Fix the weights (e.g. reload the model) or leave this layer dense with "
                "exclude=[...].")


def _check_linear(linear: nn.Module) -> None:
    if not isinstance(linear, nn.Linear):
        raise ConfigError(f"from_linear takes an nn.Linear, got {type(linear).__name__}.")
    check_finite_weight(linear, linear.weight, linear.bias)


class GatedLinear(GatedLayer):
    """``y = x @ W + b`` with W in a registered format (``"tt"``, ``"ttm"``, ... or a
    :class:`~comera.formats.registry.Format`), rank gates on its bonds; built fresh, in
    :data:`FRESH_FORMAT` unless ``format`` names another (``from_linear``: in
    :data:`DECOMPOSED_FORMAT`).

    ``ranks``: an int (every bond at most that) or one rank per bond. ``in_modes`` /
    ``out_modes``: how the features factor (a missing side is factorised, ``d`` modes when both
    are); a format that uses no modes (plain low-rank) takes none."""

    #: The format a subclass is fixed to (TTLinear: "tt"); None: any.
    fixed_format: str | None = None

    def __init__(self, in_features: int, out_features: int, format: Format | str = FRESH_FORMAT,
                 ranks: Ranks = 16, in_modes: Sequence[int] | None = None,
                 out_modes: Sequence[int] | None = None, bias: bool = True,
                 tau: float = DEFAULT_TAU, d: int = 3, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, memory: str | int = "fast",
                 parametrization: str = FRESH):
        check_features("in_features", in_features)
        check_features("out_features", out_features)
        fmt = get_format(format)
        if fmt.uses_modes:
            in_modes, out_modes = resolve_modes(in_features, out_features, in_modes, out_modes,
                                                d)
            in_modes = _check_modes(in_modes, in_features, "in_modes")
            out_modes = _check_modes(out_modes, out_features, "out_modes")
            self._check_mode_counts(in_modes, out_modes)
        elif in_modes is not None or out_modes is not None:
            raise ConfigError(f"format {fmt.name!r} uses no modes, got in_modes={in_modes!r}, "
                              f"out_modes={out_modes!r}; leave them out.")
        else:
            in_modes, out_modes = (in_features,), (out_features,)
        layout = fmt.layout(tuple(in_modes), tuple(out_modes), ranks)
        warn_full_rank(fmt, layout, ranks, type(self).__name__)  # as convert_ warns
        self._setup(layout, fmt, bias, tau, dtype, device, memory, parametrization)

    def _check_mode_counts(self, in_modes: tuple[int, ...], out_modes: tuple[int, ...]) -> None:
        """A subclass's own rule on the numbers of modes (nothing by default)."""

    def _setup(self, layout: Layout, fmt: Format, bias: bool, tau: float, dtype, device,
               memory, parametrization: str = FRESH) -> None:
        check_parametrization(parametrization)
        if self.fixed_format is not None and fmt.name != self.fixed_format:
            raise ConfigError(f"{type(self).__name__} is the {self.fixed_format!r} format, got "
                              f"format {fmt.name!r}; use GatedLinear for other formats.")
        self.in_features = layout.in_features
        self.out_features = layout.out_features
        GatedLayer.__init__(self, layout, fmt, bias, tau, dtype, device, memory)
        if parametrization == "balanced":
            self.set_core_scales_(core_scaling(layout).multipliers)
        self.parametrization = parametrization
        self.reset_cores_()
        self.build_compiled()

    @classmethod
    def from_layout(cls, layout: Layout, format: Format | str, bias: bool = True,
                    tau: float = DEFAULT_TAU, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None,
                    memory: str | int = "fast",
                    parametrization: str = FRESH) -> GatedLinear:
        """A layer of ``layout`` in ``format`` (a registered name or a Format), randomly
        initialised: how records (checkpoints, pretrained folders) rebuild a layer (loading
        its state dict then adopts the saved cores' scales)."""
        fmt = get_format(format)
        layer = cls.__new__(cls)
        layer._setup(layout, fmt, bias, tau, dtype, device, memory, parametrization)
        return layer

    @classmethod
    def from_eq(cls, eq: str, bonds: str | Sequence[str], sizes: Mapping[str, int],
                ranks: int | Mapping[str, int] | None = 16, bias: bool = True,
                tau: float = DEFAULT_TAU, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None,
                memory: str | int = "fast", parametrization: str = FRESH) -> GatedLinear:
        """A layer whose weight is the network an einsum declares, with rank gates on ``bonds``:
        ``GatedLinear.from_eq("b i j, i a, a j k -> b k", bonds="a", sizes={"i": 4, "j": 8,
        "k": 16}, ranks=8)`` maps x (B, 32) to y (B, 16) through cores (i, a) and (a, j, k).
        The first index of x and of y is the batch; the rules are
        :func:`comera.formats.einsum.layout_from_eq`'s. Randomly initialised (format "einsum"),
        so a researcher tries a structure without writing a class."""
        return cls.from_layout(layout_from_eq(eq, bonds, sizes, ranks), "einsum", bias, tau,
                               dtype, device, memory, parametrization)

    @classmethod
    def from_linear(cls, linear: nn.Linear, format: Format | str = DECOMPOSED_FORMAT,
                    ranks: Ranks = 16,
                    in_modes: Sequence[int] | None = None,
                    out_modes: Sequence[int] | None = None, tau: float = DEFAULT_TAU,
                    d: int = 3, memory: str | int = "fast",
                    parametrization: str = DECOMPOSED) -> GatedLinear:
        """A layer initialised from a trained ``nn.Linear`` by the format's decomposition (exact
        at full rank where the format's is; bonds shrink to what it found), or randomly where
        the format has none (the bias is copied either way). Plain cores by default
        (:data:`comera.formats.scaling.DECOMPOSED`)."""
        _check_linear(linear)
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, format, ranks, in_modes, out_modes,
                    linear.bias is not None, tau, d, dtype=w.dtype, device=w.device,
                    memory=memory, parametrization=parametrization)
        layer.load_weight_(w.detach().T, linear.bias)
        return layer

    def load_weight_(self, weight: Tensor, bias: Tensor | None = None) -> bool:
        """Set the cores from a dense ``weight`` (in_features x out_features) by the format's
        decomposition (:func:`load_cores_`), and the bias; False (cores unchanged) when the
        format has no decomposition."""
        cores = self.format.decompose(weight, self.layout)
        if cores is None:
            if bias is not None and self.bias is not None:
                with torch.no_grad():
                    self.bias.copy_(bias.detach())
            return False
        load_cores_(self, cores, bias)
        return True

    def to_dense(self) -> Tensor:
        """The dense weight as nn.Linear stores it: (out_features, in_features)."""
        return self.layout.dense(self.gated_cores()).T

    def extra_repr(self) -> str:
        own = "" if self.fixed_format is not None else f"format={self.format.name!r}, "
        return own + super().extra_repr()


class _ChainLinear(GatedLinear):
    """TTLinear and TTMLinear: constructors of GatedLinear at one chain format, with their
    historic signature (modes before ranks) and their d-input-modes-to-d-output-modes rule;
    nothing else (the weight, forward and dense form are GatedLinear's)."""

    def __init__(self, in_features: int, out_features: int,
                 in_modes: Sequence[int] | None = None, out_modes: Sequence[int] | None = None,
                 ranks: Ranks = 16, bias: bool = True, tau: float = DEFAULT_TAU, d: int = 3,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 memory: str | int = "fast", parametrization: str = FRESH):
        super().__init__(in_features, out_features, self.fixed_format, ranks, in_modes,
                         out_modes, bias, tau, d, dtype, device, memory, parametrization)

    def _check_mode_counts(self, in_modes: tuple[int, ...], out_modes: tuple[int, ...]) -> None:
        if len(in_modes) != len(out_modes):
            raise ConfigError(
                f"in_modes {in_modes} and out_modes {out_modes} differ in length; the "
                f"{get_format(self.fixed_format).title} format pairs d input modes with d "
                "output modes."
            )

    @classmethod
    def from_linear(cls, linear: nn.Linear, ranks: Ranks = 16,
                    in_modes: Sequence[int] | None = None,
                    out_modes: Sequence[int] | None = None, tau: float = DEFAULT_TAU,
                    d: int = 3, memory: str | int = "fast", parametrization: str = DECOMPOSED):
        """A layer initialised by the chain's SVD of a trained ``nn.Linear`` (exact at full
        rank)."""
        _check_linear(linear)
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, in_modes, out_modes, ranks,
                    linear.bias is not None, tau, d, dtype=w.dtype, device=w.device,
                    memory=memory, parametrization=parametrization)
        layer.load_weight_(w.detach().T, linear.bias)
        return layer

    def to_dense(self) -> Tensor:
        """The dense weight as nn.Linear stores it: (out_features, in_features), by the
        format's own contraction (:meth:`Format.dense`; GatedLinear.to_dense may read it too)."""
        return self.format.dense(self.gated_cores(), self.layout).T


class TTLinear(_ChainLinear):
    """y = x @ W + b with W in the CoMERA TT format (input modes, then output modes):
    ``GatedLinear(format="tt")`` with modes before ranks."""

    fixed_format = "tt"


class TTMLinear(_ChainLinear):
    """y = x @ W + b with W in the interleaved TT-matrix format (cores (r, m_k, n_k, r)):
    ``GatedLinear(format="ttm")`` with modes before ranks."""

    fixed_format = "ttm"


def load_cores_(layer: GatedLayer, cores: Sequence[Tensor], bias: Tensor | None) -> None:
    """Copy decomposed cores (as the network reads them; their bonds may be smaller than the
    layer's: the decomposition found a lower exact rank) into ``layer``; each gate takes its
    bond's new size (ones). A balanced layer first spreads the cores' scalar gauge evenly
    (:func:`~comera.formats.scaling.balance_gauge`) and stores each core over its scale; both
    are powers of two, so the weight is exactly the decomposition's."""
    if len(cores) != len(layer.cores):
        raise ConfigError(f"{len(cores)} cores for a layer of {len(layer.cores)}; a "
                          "decomposition gives one core per core of the layout.")
    if layer.parametrization != "plain":
        cores = balance_gauge(cores, layer.core_scale_values)
        cores = [c / s if s != 1.0 else c for c, s in zip(cores, layer._scales, strict=True)]
    with torch.no_grad():
        for k, core in enumerate(cores):
            target = layer.cores[k]
            if tuple(core.shape) != tuple(target.shape):  # the SVD found a lower exact rank
                layer.cores[k] = nn.Parameter(core.to(target.dtype).clone())
            else:
                target.copy_(core)
        for k, (gate, (c, axis)) in enumerate(zip(layer.gates, layer.gate_folds(),
                                                  strict=True)):
            size = layer.cores[c].shape[axis]
            if gate.numel() != size:
                layer.gates[k] = nn.Parameter(torch.ones(size, dtype=gate.dtype,
                                                         device=gate.device))
        if bias is not None and layer.bias is not None:
            layer.bias.copy_(bias.detach())
    layer.layout  # noqa: B018  (checks the new shapes fit the layout)
    layer.build_compiled()
