"""Tensor-train linear layers with diagonal rank gates, contracted by tncomp plans.

``TTLinear`` stores W (in x out) in the CoMERA TT format: 2d cores (r_{k-1}, n_k, r_k) over
``in_modes + out_modes``. ``TTMLinear`` stores the interleaved TT-matrix format: d cores
(r_{k-1}, m_k, n_k, r_k). Between consecutive cores sits a gate vector d_k (initialised to 1);
entries with |d_k| <= tau count as zero: they scale their rank slice to zero and receive no
gradient. The gated cores are passed to a compiled tncomp network, so the forward and backward
contractions are planned (no hand-written per-order code here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

import tncomp
from comera.errors import ConfigError, ConversionError, NonFiniteError
from comera.formats.factorize import factorize, factorize_pair
from comera.formats.ttsvd import matrix_to_tt, matrix_to_ttm, tt_to_matrix, ttm_to_matrix
from tncomp import autocast_cast, autocast_dtype, check_modes
from tncomp import check_memory as _check_tncomp_memory

DEFAULT_TAU = 1e-2
Ranks = int | Sequence[int]


def resolve_bonds(ranks: Ranks, bond_modes: Sequence[int], what: str) -> tuple[int, ...]:
    """The interior bond sizes ``ranks`` asks for (tncomp's rule), a bad request as
    :class:`ConfigError`: shared by every gated layer."""
    try:
        return tncomp.resolve_ranks(ranks, bond_modes, what)
    except tncomp.errors.IRError as exc:
        raise ConfigError(str(exc)) from None


def check_features(name: str, value: int) -> int:
    """``value`` as a feature size (an int >= 1), else :class:`ConfigError` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r}; a feature size is an int >= 1.")
    return value


def _check_modes(modes, features: int, what: str) -> tuple[int, ...]:
    try:
        modes = check_modes(modes, what)  # tncomp's one check of modes
    except tncomp.errors.IRError as exc:
        raise ConfigError(str(exc)) from None
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
    large tensors fresh pages each time. At B=4096 a 768->3072 layer's ``y + bias`` took 18 ms
    (fresh pages) where ``y.add_(bias)`` took 2 ms and the layer's own forward about 10 ms; the
    second buffer also raised the peak by one output. ``nn.Linear`` folds its bias into addmm.
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
    try:
        return _check_tncomp_memory(memory)
    except tncomp.errors.OptionError as exc:
        raise ConfigError(str(exc)) from None


def check_tau(tau: float) -> float:
    """``tau`` as a gate threshold (a number >= 0), else :class:`ConfigError`."""
    if not isinstance(tau, int | float) or tau < 0 or math.isnan(tau):
        raise ConfigError(f"tau={tau!r}; the gate threshold is a number >= 0 (default 1e-2).")
    return float(tau)


class GatedTrain(nn.Module):
    """What TT and TT-matrix layers share: cores, rank gates, tau, bias and the compiled plan."""

    in_features: int
    out_features: int

    def __init__(self, core_shapes, bias: bool, out_features: int, tau: float,
                 dtype=None, device=None, memory: str | int = "fast"):
        super().__init__()
        self.tau = check_tau(tau)
        factory = {"dtype": dtype, "device": device}
        self.cores = nn.ParameterList(
            [nn.Parameter(torch.empty(shape, **factory)) for shape in core_shapes])
        self.gates = nn.ParameterList(
            [nn.Parameter(torch.ones(shape[-1], **factory)) for shape in core_shapes[:-1]])
        self.bias = nn.Parameter(torch.zeros(out_features, **factory)) if bias else None
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
    def bonds(self) -> tuple[int, ...]:
        """Stored (physical) bond sizes, ends included."""
        return (1, *(int(c.shape[-1]) for c in self.cores))

    @property
    def ranks(self) -> tuple[int, ...]:
        """Effective bond sizes: gate entries above tau, ends included."""
        return (1, *(int(m.sum()) for m in self.gate_masks()), 1)

    def gate_masks(self) -> list[Tensor]:
        """Per gate, a bool mask of the rank slices still alive (``|gate| > tau``), detached.
        A NaN entry counts as alive: it still reaches the output, so it is never pruned
        silently (:meth:`check_finite_gates` refuses it where ranks are cut)."""
        return [~(g.detach().abs() <= self.tau) for g in self.gates]

    def effective_gates(self) -> list[Tensor]:
        """Gates with the entries at or below tau zeroed (and cut off from the gradient)."""
        return [g * m.to(g.dtype) for g, m in zip(self.gates, self.gate_masks(), strict=True)]

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

    def gated_cores(self) -> list[Tensor]:
        """Cores with each gate folded into the right bond of the core before it."""
        gates = self.effective_gates()
        out = []
        for k, core in enumerate(self.cores):
            out.append(core * gates[k] if k < len(gates) else core)
        return out

    def is_removed(self) -> bool:
        """True when some gate is entirely zero: the TT weight is then exactly zero."""
        return any(not bool(m.any()) for m in self.gate_masks())

    def num_parameters(self, effective: bool = True) -> int:
        """Parameters of the layer. ``effective``: cores at the effective ranks (gates fold into
        the cores), zero for a removed layer, plus the bias. Otherwise: every stored parameter."""
        bias = self.bias.numel() if self.bias is not None else 0
        if not effective:
            return sum(p.numel() for p in self.parameters())
        if self.is_removed():
            return bias
        ranks = self.ranks
        return bias + sum(ranks[k] * math.prod(c.shape[1:-1]) * ranks[k + 1]
                          for k, c in enumerate(self.cores))

    def dense_num_parameters(self) -> int:
        """Parameters of the equivalent dense layer: ``in_features * out_features`` + bias."""
        return self.in_features * self.out_features + (
            self.bias.numel() if self.bias is not None else 0)

    # -- compute --------------------------------------------------------------------------------
    def _network(self) -> tncomp.Network:
        raise NotImplementedError

    def _structure(self) -> tuple:
        """Whatever besides the core shapes decides the network (part of the plan key)."""
        return ()

    def compiled(self) -> tncomp.CompiledNetwork:
        """The compiled contraction for the current core shapes (re-planned after truncation)."""
        shapes = (tuple(tuple(c.shape) for c in self.cores), self._structure(),
                  tuple(sorted(self.compile_options.items())))
        if self._compiled is None or self._compiled_for != shapes:
            self._compiled = tncomp.compile(self._network(), **self.compile_options)
            self._compiled_for = shapes
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
        self.build_compiled()

    def __getstate__(self):  # compiled plans hold generated code: rebuild after unpickling
        state = self.__dict__.copy()
        state["_compiled"] = None
        state["_compiled_for"] = None
        return state

    def _gaussian_init_(self, n_cores: int) -> None:
        """Gaussian cores scaled so the dense weight has variance about 1/(fan_in + fan_out).
        Cores on the meta device hold no values: nothing to draw."""
        if self.cores[0].is_meta:
            return
        bonds = self.bonds
        target = 1.0 / (self.in_features + self.out_features)
        std = (target / math.prod(bonds)) ** (1.0 / (2 * n_cores))
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
                f"bias={self.bias is not None}, tau={self.tau}")


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


class _LinearTrain(GatedTrain):
    """What TT and TT-matrix linear layers share: mode checks, construction, from_linear."""

    format_name = ""

    def __init__(self, in_features: int, out_features: int,
                 in_modes: Sequence[int] | None = None, out_modes: Sequence[int] | None = None,
                 ranks: Ranks = 16, bias: bool = True, tau: float = DEFAULT_TAU, d: int = 3,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 memory: str | int = "fast"):
        self.in_features = check_features("in_features", in_features)
        self.out_features = check_features("out_features", out_features)
        in_modes, out_modes = resolve_modes(in_features, out_features, in_modes, out_modes, d)
        self.in_modes = _check_modes(in_modes, in_features, "in_modes")
        self.out_modes = _check_modes(out_modes, out_features, "out_modes")
        if len(self.in_modes) != len(self.out_modes):
            raise ConfigError(
                f"in_modes {self.in_modes} and out_modes {self.out_modes} differ in length; the "
                f"{self.format_name} format pairs d input modes with d output modes."
            )
        shapes = self._core_shapes(ranks)
        super().__init__(shapes, bias, out_features, tau, dtype, device, memory)
        self._gaussian_init_(len(shapes))
        self.build_compiled()

    def _core_shapes(self, ranks: Ranks) -> list[tuple[int, ...]]:
        raise NotImplementedError

    @staticmethod
    def _decompose(weight: Tensor, in_modes, out_modes, interior: list[int]) -> list[Tensor]:
        raise NotImplementedError

    @classmethod
    def from_linear(cls, linear: nn.Linear, ranks: Ranks = 16,
                    in_modes: Sequence[int] | None = None,
                    out_modes: Sequence[int] | None = None, tau: float = DEFAULT_TAU,
                    d: int = 3, memory: str | int = "fast"):
        """A layer initialised by TT-SVD of a trained ``nn.Linear`` (exact at full rank)."""
        if not isinstance(linear, nn.Linear):
            raise ConfigError(f"from_linear takes an nn.Linear, got {type(linear).__name__}.")
        check_finite_weight(linear, linear.weight, linear.bias)
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, in_modes, out_modes, ranks,
                    linear.bias is not None, tau, d, dtype=w.dtype, device=w.device,
                    memory=memory)
        cores = cls._decompose(w.detach().T, layer.in_modes, layer.out_modes,
                               list(layer.bonds[1:-1]))
        load_cores_(layer, cores, linear.bias)
        return layer


class TTLinear(_LinearTrain):
    """y = x @ W + b with W in the CoMERA TT format (input modes, then output modes)."""

    format_name = "TT"

    def _core_shapes(self, ranks: Ranks) -> list[tuple[int, ...]]:
        modes = self.in_modes + self.out_modes
        bonds = resolve_bonds(ranks, modes, "ranks")
        return [(bonds[k], n, bonds[k + 1]) for k, n in enumerate(modes)]

    _decompose = staticmethod(matrix_to_tt)

    def _network(self) -> tncomp.Network:
        return tncomp.tt_linear(self.in_modes, self.out_modes, self.bonds)

    def to_dense(self) -> Tensor:
        """The dense weight as nn.Linear stores it: (out_features, in_features)."""
        return tt_to_matrix(self.gated_cores(), len(self.in_modes)).T


class TTMLinear(_LinearTrain):
    """y = x @ W + b with W in the interleaved TT-matrix format (cores (r, m_k, n_k, r))."""

    format_name = "TT-matrix"

    def _core_shapes(self, ranks: Ranks) -> list[tuple[int, ...]]:
        pairs = list(zip(self.in_modes, self.out_modes, strict=True))
        bonds = resolve_bonds(ranks, [m * n for m, n in pairs], "ranks")
        return [(bonds[k], m, n, bonds[k + 1]) for k, (m, n) in enumerate(pairs)]

    _decompose = staticmethod(matrix_to_ttm)

    def _network(self) -> tncomp.Network:
        return tncomp.ttm_linear(self.in_modes, self.out_modes, self.bonds)

    def to_dense(self) -> Tensor:
        """The dense weight as nn.Linear stores it: (out_features, in_features)."""
        return ttm_to_matrix(self.gated_cores()).T


def load_cores_(layer: GatedTrain, cores: Sequence[Tensor], bias: Tensor | None) -> None:
    """Copy TT-SVD cores (possibly of smaller rank than requested) into ``layer``."""
    with torch.no_grad():
        for k, core in enumerate(cores):
            target = layer.cores[k]
            if tuple(core.shape) != tuple(target.shape):  # the SVD found a lower exact rank
                layer.cores[k] = nn.Parameter(core.to(target.dtype).clone())
            else:
                target.copy_(core)
        for k, gate in enumerate(layer.gates):
            size = layer.cores[k].shape[-1]
            if gate.numel() != size:
                layer.gates[k] = nn.Parameter(torch.ones(size, dtype=gate.dtype,
                                                         device=gate.device))
        if bias is not None and layer.bias is not None:
            layer.bias.copy_(bias.detach())
    layer.build_compiled()
