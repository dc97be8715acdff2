"""CoLA: a low-rank bottleneck with a nonlinearity between its factors, ``y = B act(A x) + b``.

CoLA (Liu et al. 2025, from the CoMERA group) replaces each linear layer of a model trained from
scratch by two factors, A (in, r) and B (r, out), with an activation (SiLU) between them. It is
NOT a weight format: the layer is nonlinear, so it has no dense weight (no ``to_dense``), no
decomposition of a trained ``nn.Linear`` and no exact rounding, and it is not in
:mod:`comera.formats.registry`. Models ask for it by its layer kind, ``"cola"``
(:data:`comera.models.transformer.LAYER_KINDS`), beside ``"dense"`` and the formats.

What it shares with the format layers is everything CoMERA does with ranks: it is a
:class:`~comera.layers.linear.GatedLayer` whose layout is the two factors with the bottleneck r
as its one bond, so the gate g (length r, initialised to 1, entries at or below tau pruned) and
the rank objective, sizes, compression ratio and truncation read it as they read any gated
layer. The gate scales ``act(A x)``: ``y = B (g * act(A x)) + b``. It therefore folds into B
(along r), and B is the layout's first core, because a gate folds into the first core carrying
its bond: ``cores = [B (r, out), A (in, r)]``.

Initialisation (both parametrizations): the cores are drawn at the balanced stds of the
two-factor layout (:func:`~comera.formats.scaling.core_scaling`: ``A x`` of variance
``g = 3 ** -0.5`` for inputs of unit second moment), then B's std is multiplied by
``sqrt(g / m2)``, ``m2`` the second moment of ``act(z)`` for ``z ~ N(0, g)`` (Gauss-Hermite
quadrature). The output's second moment is then ``1 / 3``, as ``nn.Linear``'s default
initialisation gives on such inputs. ``"balanced"``: semi-orthogonal cores and the multipliers
of :mod:`comera.formats.scaling` (B's times the power of two nearest the gain); ``"plain"``:
Gaussian cores at the same stds, no multipliers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from comera.errors import ConfigError
from comera.formats.layout import Layout
from comera.formats.registry import Format
from comera.formats.scaling import (
    FRESH,
    CoreScaling,
    check_parametrization,
    core_scaling,
    orthogonal_cores,
    power_of_two,
)
from comera.layers.linear import DEFAULT_TAU, GatedLayer, check_features
from comera.numbers import is_int

__all__ = ["ACTIVATIONS", "ColaFactors", "ColaLinear", "activation_second_moment"]

#: The activations between the factors, by name ("identity": a plain low-rank layer).
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
    "identity": lambda z: z,
}


def check_activation(value: str) -> str:
    """``value`` if it names an activation of :data:`ACTIVATIONS`, else a ConfigError."""
    if not isinstance(value, str) or value not in ACTIVATIONS:
        raise ConfigError(f"activation={value!r}; choose one of "
                          f"{', '.join(map(repr, ACTIVATIONS))} (CoLA's is 'silu').")
    return value


def activation_second_moment(activation: str, variance: float, points: int = 80) -> float:
    """``E[act(z)^2]`` for ``z ~ N(0, variance)``, by Gauss-Hermite quadrature (float64)."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(points)  # weight exp(-x^2 / 2)
    z = torch.from_numpy(nodes * math.sqrt(variance))
    values = ACTIVATIONS[check_activation(activation)](z).double() ** 2
    return float((torch.from_numpy(weights) * values).sum()) / math.sqrt(2 * math.pi)


class ColaFactors(Format):
    """The two factors of a CoLA layer as a layout: B (r, o) first, then A (i, r); the bond r.
    A structure, not a weight format: never registered, no dense weight (the layer is
    nonlinear), no decomposition, no rounding."""

    name, title, uses_modes, table = "cola", "CoLA", False, None

    def layout(self, in_modes, out_modes, ranks) -> Layout:
        n_in, n_out = math.prod(in_modes), math.prod(out_modes)
        rank = ranks[0] if isinstance(ranks, tuple | list) and len(ranks) == 1 else ranks
        if not is_int(rank):
            raise ConfigError(f"rank={rank!r}; CoLA's bottleneck is an int >= 1 (e.g. "
                              f"{max(1, min(n_in, n_out) // 4)}).")
        return Layout(("i",), ("o",), (("r", "o"), ("i", "r")),
                      (("i", n_in), ("o", n_out), ("r", rank)), ("r",))

    def dense(self, cores, layout: Layout) -> Tensor:
        raise ConfigError("a CoLA layer is nonlinear (B act(A x)): it has no dense weight; "
                          "compare its outputs instead.")


COLA = ColaFactors()


def cola_scaling(layout: Layout, activation: str) -> CoreScaling:
    """The balanced stds and multipliers of the two factors, B's corrected for the activation
    so the output's second moment is ``nn.Linear``'s (see the module docstring)."""
    base = core_scaling(layout)  # in layout order: B, A
    g = 3.0 ** -0.5  # the variance of A x (and, for the identity, of act(A x)) at init
    gain = math.sqrt(g / activation_second_moment(activation, g))
    return CoreScaling((base.stds[0] * gain, base.stds[1]),
                       (base.multipliers[0] * power_of_two(gain), base.multipliers[1]))


class ColaLinear(GatedLayer):
    """``y = B (g * act(A x)) + b`` for ``x`` of shape ``(..., in_features)``: A (in, rank),
    B (rank, out), the gate g (rank) pruned at tau. Not a weight format (see the module
    docstring). ``rank`` may exceed ``min(in, out)``: the nonlinearity makes a wider
    bottleneck a different function (an MLP), though it no longer compresses."""

    def __init__(self, in_features: int, out_features: int, rank: int,
                 activation: str = "silu", bias: bool = True, tau: float = DEFAULT_TAU,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 parametrization: str = FRESH):
        self.in_features = check_features("in_features", in_features)
        self.out_features = check_features("out_features", out_features)
        self.activation = check_activation(activation)
        check_parametrization(parametrization)
        layout = COLA.layout((in_features,), (out_features,), rank)
        super().__init__(layout, COLA, bias, tau, dtype, device)
        self.parametrization = parametrization
        if parametrization == "balanced":
            self.set_core_scales_(cola_scaling(layout, activation).multipliers)
        self.reset_cores_()

    @property
    def rank(self) -> int:
        """The stored bottleneck width (the gate's length)."""
        return self.bond_sizes[0]

    def build_compiled(self) -> None:
        """Nothing to plan: the forward is two matrix products around the activation."""

    def reset_cores_(self) -> None:
        """Draw A and B at the activation-corrected balanced stds (semi-orthogonal when
        balanced, Gaussian when plain), gates of one, bias zero."""
        if self.cores[0].is_meta:
            return
        layout = self.layout
        scaling = cola_scaling(layout, self.activation)
        factory = {"dtype": self.cores[0].dtype, "device": self.cores[0].device}
        if self.parametrization == "balanced":
            cores = orthogonal_cores(layout, scaling, **factory)
        else:
            cores = [torch.randn(shape, **factory) * std
                     for shape, std in zip(layout.core_shapes, scaling.stds, strict=True)]
        self._start_from_(cores)

    def forward(self, x: Tensor) -> Tensor:
        """``B (g * act(A x)) + b``: a tensor of shape ``(..., out_features)``."""
        if not isinstance(x, Tensor) or x.dim() == 0 or x.shape[-1] != self.in_features:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ConfigError(f"ColaLinear expects inputs of shape (..., {self.in_features}), "
                              f"got {got}.")
        up, down = self.gated_cores()  # (r, o) with the gate folded in, (i, r)
        h = ACTIVATIONS[self.activation](x @ down)  # (..., r)
        if self.bias is None:
            return h @ up  # (..., o)
        if h.dim() == 2:
            return torch.addmm(self.bias.to(h.dtype), h, up.to(h.dtype))  # (rows, o)
        return h @ up + self.bias.to(h.dtype)  # (..., o)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.rank}, live={self.bond_ranks[0]}, activation="
                f"{self.activation!r}, bias={self.bias is not None}, tau={self.tau}, "
                f"parametrization={self.parametrization!r}")
