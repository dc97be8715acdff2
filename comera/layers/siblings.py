"""Sibling TT layers that read one input, contracted as one stacked network.

Attention's q, k and v projections all read the same tensor. Called one by one, each layer
reads x and runs its own input-side GEMM with a narrow (rank-wide) output. :class:`Siblings`
stacks their gated cores along a new leading axis ``s`` and contracts them through
:func:`tncomp.stack_siblings` of their network: x is read once, the input-side
GEMM is one ``n * r`` wide product, the per-sibling steps are batched GEMMs, and autograd splits
the stacked gradient back into each layer's own cores and gates (``torch.stack`` in forward).
The layers themselves stay as they are: their parameters, state_dict and checkpoints.

Siblings stack when they are gated linear layers (:class:`~comera.layers.linear.GatedLinear`:
TTLinear, TTMLinear or any format) of the same class, format, layout (up to bond sizes),
dtype, device and compile options. Ranks may differ (rank-adaptive training prunes them apart,
``truncate_`` removes the pruned slices physically): each core is padded with zero slices on
every bond axis up to that bond's largest size. That is exact: a zero slice adds exactly zero
to every sum, and the padding is a constant, so no gradient reaches it (rank pruning by gates
already computes on such zeros). Padding costs work, so the siblings stack only while the padded
bonds sum to at most ``MAX_PADDING`` times the stored ones; beyond that, and for inputs with no
rows, they run one by one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import tncomp
from comera.formats.layout import Layout
from comera.layers.linear import GatedLinear, add_bias
from tncomp import stack_siblings
from tncomp.extend import autocast_cast, autocast_dtype

# Stack while the padded bonds sum to at most this many times the stored ones (the work that
# grows with the batch is linear in each bond); the measurement that set it is in
# docs/results.md, "Measured rules of the CPU executor".
MAX_PADDING = 2.25


def _padded_bonds(layers: Sequence[GatedLinear]) -> tuple[int, ...]:
    return tuple(max(sizes) for sizes in zip(*(layer.bond_sizes for layer in layers),
                                             strict=True))


def _fixed(layout: Layout) -> tuple:
    """The layout without its bond sizes: what siblings must share."""
    sizes = tuple((n, s) for n, s in layout.sizes if n not in layout.bonds)
    return layout.inputs, layout.outputs, layout.cores, layout.bonds, sizes


def stack_key(layers: Sequence[nn.Module]) -> tuple | None:
    """What decides the stacked network of ``layers`` (class, format, layout, padded bonds,
    dtype, device, compile options), or None when they do not stack (see the module
    docstring)."""
    if len(layers) < 2:
        return None
    first = layers[0]
    kind = type(first)
    if not isinstance(first, GatedLinear):
        return None
    dtype, device = first.cores[0].dtype, first.cores[0].device
    options = tuple(sorted(first.compile_options.items()))
    fixed = _fixed(first.layout)
    for layer in layers:
        if (type(layer) is not kind or type(layer.format) is not type(first.format)
                or layer.format.name != first.format.name
                or _fixed(layer.layout) != fixed
                or tuple(sorted(layer.compile_options.items())) != options
                or any(c.dtype != dtype or c.device != device for c in layer.cores)):
            return None
    bonds = _padded_bonds(layers)
    stored = sum(sum(layer.bond_sizes) for layer in layers)
    if len(layers) * sum(bonds) > MAX_PADDING * stored:
        return None
    return kind, first.format.name, fixed, bonds, len(layers), dtype, device, options


def _pad(core: Tensor, target: Sequence[int]) -> Tensor:
    """``core`` with zero slices appended on each axis up to ``target`` (its padded shape)."""
    grow = [t - n for t, n in zip(target, core.shape, strict=True)]
    if not any(grow):
        return core
    pad = [0] * (2 * core.dim())
    for axis, g in enumerate(grow):
        pad[2 * (core.dim() - 1 - axis) + 1] = g  # F.pad lists the last axis first
    return F.pad(core, pad)


class Siblings:
    """Applies TT layers that read the same input as one stacked contraction.

    Held by the module that owns the layers (an attention block); it is no ``nn.Module`` and
    holds no tensors, so state_dicts and checkpoints do not change. ``siblings(layers, x)``
    returns ``[layer(x) for layer in layers]``, stacked when the layers stack."""

    def __init__(self) -> None:
        self._compiled: tncomp.CompiledNetwork | None = None
        self._compiled_for: tuple | None = None
        self._padded_shapes: tuple[tuple[int, ...], ...] = ()

    def build_compiled(self, layers: Sequence[nn.Module]) -> bool:
        """Build the stacked network of ``layers``' current shapes now (outside any
        ``torch.compile`` trace); False when they do not stack."""
        key = stack_key(layers)
        if key is None:
            return False
        if self._compiled_for != key:
            first = layers[0]
            _, _, _, bonds, n, _, _, options = key
            padded = first.layout.resized(dict(zip(first.layout.bonds, bonds, strict=True)))
            net = stack_siblings(first.format.network(padded), n)
            self._compiled = tncomp.compile(net, **dict(options))
            self._compiled_for = key
            self._padded_shapes = padded.core_shapes
        return True

    def __call__(self, layers: Sequence[nn.Module], x: Tensor) -> list[Tensor]:
        """``[layer(x) for layer in layers]``, from one stacked contraction when they stack."""
        first = layers[0]
        key = stack_key(layers)
        if key is None or x.shape[-1:] != (getattr(first, "in_features", -1),) or x.numel() == 0:
            return [layer(x) for layer in layers]  # one by one (and their own input checks)
        if self._compiled_for != key:
            if torch.compiler.is_compiling():  # building one inside a trace breaks the graph
                return [layer(x) for layer in layers]
            self.build_compiled(layers)
        lead = x.shape[:-1]
        xm = x.reshape(math.prod(lead), *first.in_modes)  # (B, *in_modes)
        gated = [layer.gated_cores() for layer in layers]
        cores = [torch.stack([_pad(g[k], shape) for g in gated])  # (n, *core k's padded shape)
                 for k, shape in enumerate(self._padded_shapes)]
        low = autocast_dtype(x.device.type)
        if low is not None:  # as the layers do: compute in the autocast dtype
            xm, cores = autocast_cast(xm, low), [autocast_cast(c, low) for c in cores]
        y = self._compiled(xm, *cores)  # (n, B, *out_modes)
        if any(layer.bias is not None for layer in layers):  # one add for all n (zeros: none)
            biases = torch.stack([layer.bias if layer.bias is not None else
                                  first.cores[0].new_zeros(first.out_features)
                                  for layer in layers])
            y = add_bias(y, biases.view(len(layers), 1, *first.out_modes), xm)
        return [ys.reshape(*lead, layer.out_features)  # one stack in backward
                for layer, ys in zip(layers, y.unbind(0), strict=True)]

    @property
    def stacked(self) -> tncomp.CompiledNetwork | None:
        """The compiled stacked network of the last layers seen (None before any)."""
        return self._compiled

    def __getstate__(self) -> dict:  # compiled plans hold generated code: rebuild when used
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()
