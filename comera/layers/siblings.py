"""Sibling TT layers that read one input, contracted as one stacked network.

Attention's q, k and v projections all read the same tensor. Called one by one, each layer
reads x and runs its own input-side GEMM with a narrow (rank-wide) output. :class:`Siblings`
stacks their gated cores along a new leading axis ``s`` and contracts them through
:func:`tncomp.stack_siblings` of their network: x is read once, the input-side
GEMM is one ``n * r`` wide product, the per-sibling steps are batched GEMMs, and autograd splits
the stacked gradient back into each layer's own cores and gates (``torch.stack`` in forward).
The layers themselves stay as they are: their parameters, state_dict and checkpoints.

Siblings stack when they have the same class (TTLinear or TTMLinear), modes, dtype, device and
compile options. Ranks may differ (rank-adaptive training prunes them apart, ``truncate_``
removes the pruned slices physically): each core is padded with zero slices up to the largest
bond. That is exact: a zero slice adds exactly zero to every sum, and the padding is a
constant, so no gradient reaches it (rank pruning by gates already computes on such zeros).
Padding costs work, so the siblings stack only while the padded bonds sum to at most
``MAX_PADDING`` times the stored ones (interior bonds); beyond that, and for inputs with no
rows, they run one by one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import tncomp
from comera.layers.linear import TTLinear, TTMLinear, add_bias
from tncomp import autocast_cast, autocast_dtype, stack_siblings

# The network of each stackable layer class, at given modes and bonds.
BUILDERS = {TTLinear: tncomp.tt_linear, TTMLinear: tncomp.ttm_linear}
# Stack while the padded bonds sum to at most this many times the stored ones (the work that
# grows with the batch is linear in each bond). Measured on CPU, 1 thread, 768x768 q/k/v at
# B = 16..4096: stacking was as fast or faster up to a ratio of 2.15 (ranks 30, 6 and 3).
MAX_PADDING = 2.25


def _padded_bonds(layers: Sequence[nn.Module]) -> tuple[int, ...]:
    return tuple(max(bonds) for bonds in zip(*(layer.bonds for layer in layers), strict=True))


def stack_key(layers: Sequence[nn.Module]) -> tuple | None:
    """What decides the stacked network of ``layers`` (class, modes, padded bonds, dtype, device,
    compile options), or None when they do not stack (see the module docstring)."""
    if len(layers) < 2:
        return None
    first = layers[0]
    kind = type(first)
    if kind not in BUILDERS:
        return None
    dtype, device = first.cores[0].dtype, first.cores[0].device
    options = tuple(sorted(first.compile_options.items()))
    for layer in layers:
        if (type(layer) is not kind or layer.in_modes != first.in_modes
                or layer.out_modes != first.out_modes
                or tuple(sorted(layer.compile_options.items())) != options
                or any(c.dtype != dtype or c.device != device for c in layer.cores)):
            return None
    bonds = _padded_bonds(layers)
    stored = sum(sum(layer.bonds[1:-1]) for layer in layers)  # interior bonds
    if len(layers) * sum(bonds[1:-1]) > MAX_PADDING * stored:
        return None
    return kind, first.in_modes, first.out_modes, bonds, len(layers), dtype, device, options


def _pad(core: Tensor, left: int, right: int) -> Tensor:
    """``core`` (r, ..., r') with zero slices appended up to (left, ..., right)."""
    grow_left, grow_right = left - core.shape[0], right - core.shape[-1]
    if not grow_left and not grow_right:
        return core
    pad = [0] * (2 * core.dim())
    pad[1], pad[-1] = grow_right, grow_left  # F.pad lists the last axis first
    return F.pad(core, pad)


class Siblings:
    """Applies TT layers that read the same input as one stacked contraction.

    Held by the module that owns the layers (an attention block); it is no ``nn.Module`` and
    holds no tensors, so state_dicts and checkpoints do not change. ``siblings(layers, x)``
    returns ``[layer(x) for layer in layers]``, stacked when the layers stack."""

    def __init__(self) -> None:
        self._compiled: tncomp.CompiledNetwork | None = None
        self._compiled_for: tuple | None = None

    def build_compiled(self, layers: Sequence[nn.Module]) -> bool:
        """Build the stacked network of ``layers``' current shapes now (outside any
        ``torch.compile`` trace); False when they do not stack."""
        key = stack_key(layers)
        if key is None:
            return False
        if self._compiled_for != key:
            kind, in_modes, out_modes, bonds, n, _, _, options = key
            net = stack_siblings(BUILDERS[kind](in_modes, out_modes, bonds), n)
            self._compiled = tncomp.compile(net, **dict(options))
            self._compiled_for = key
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
        bonds = key[3]
        lead = x.shape[:-1]
        xm = x.reshape(math.prod(lead), *first.in_modes)  # (B, *in_modes)
        gated = [layer.gated_cores() for layer in layers]
        cores = [torch.stack([_pad(g[k], bonds[k], bonds[k + 1]) for g in gated])  # (n, r, ., r')
                 for k in range(len(bonds) - 1)]
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
