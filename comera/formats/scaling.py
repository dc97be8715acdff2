"""The structure-aware parametrization: each core's initial values and step size from its own
place in the network, so a compressed layer trains like the dense layer it replaces.

A product of cores trains badly with one scale for every core. Under Adam a step moves every
entry by about the learning rate, so a core whose entries are small moves far relative to its
size and a core whose entries are large barely moves; and a chain of Gaussian cores multiplies
into a weight with a few large singular values and many tiny ones (a deep linear network's
conditioning), where a dense layer's are spread evenly. Read each core as one layer of the flow
from x to y (:meth:`~comera.formats.layout.Layout.core_fans`):

- **initial values**: core k is a random semi-orthogonal map from its fan-in to its fan-out
  (batched over its block indices), scaled to the variance ``g / fan_in_k``; every core is then
  well conditioned, each intermediate keeps the input's scale, and the weight W has exactly the
  variance of ``nn.Linear``'s default initialisation, ``1 / (3 * in_features)``, for any format
  (the fan-ins multiply to ``in_features`` times the internal sizes, ``g`` is
  ``(1/3) ** (1/n)``);
- **step sizes**: the network reads core k as ``multiplier_k * stored_k``; an optimizer that
  moves entries by about the learning rate (Adam, AdamW, Adagrad...) then moves core k by
  ``multiplier_k`` times it. The multipliers make every core's relative update the same and the
  n cores' together the relative update of the dense weight at the same learning rate:
  ``multiplier_k = std_k / (n * std_dense)``, rounded to a power of two so that scaling a stored
  core is exact (a converted layer's weight is bit for bit the decomposition's).

Nothing here changes what a layer computes for given effective cores: the multipliers are a
reparametrization, stored with the layer (its ``core_scales`` buffer) so checkpoints read back
exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from comera.errors import ConfigError
from comera.formats.layout import Layout
from tncomp.extend import renamed

__all__ = ["DECOMPOSED", "FRESH", "PARAMETRIZATIONS", "CoreScaling", "balance_gauge",
           "check_parametrization", "core_scaling", "orthogonal_cores",
           "structure_aware_multipliers"]

#: "balanced": the structure-aware initialisation and multipliers; "plain": one Gaussian scale for
#: every core and no multipliers (before issue 30).
PARAMETRIZATIONS = ("balanced", "plain")
#: The default of gated layers built fresh: ``GatedLinear`` and the other layer constructors, and
#: the models comera's tasks build (``CausalLMConfig``, ``TransformerConfig``, the LM / MLM task
#: configs), so CoMERA trained from scratch too. Balanced cores train better at a fixed rank in
#: every format measured, and rank-adaptively once the late stage shapes them from their spectra
#: (the engine's ``late_allocation="auto"`` on chains) instead of pruning their gates, which a
#: balanced model, its weight spread over its whole rank, does not survive (docs/results.md).
FRESH = "balanced"
#: The default of layers decomposed from given weights (``from_linear``, ``convert_``): on them the
#: balanced scales measured no better than plain ones (fine-tuning a trained LM) or worse
#: (training a converted, freshly initialised GPT); docs/results.md, issue 30.
DECOMPOSED = "plain"


#: ``RANK_ADAPTIVE`` (until 0.3.0): the task models' default, "plain" before 0.2.0, now
#: :data:`FRESH` like every layer built fresh.
__getattr__ = renamed(__name__, {"RANK_ADAPTIVE": (f"{__name__}:FRESH", "0.3.0")})


def check_parametrization(value: str) -> str:
    """``value`` if it names a parametrization, else a :class:`ConfigError` naming the
    choices."""
    if value not in PARAMETRIZATIONS:
        raise ConfigError(f"parametrization={value!r}; choose one of "
                          f"{', '.join(map(repr, PARAMETRIZATIONS))}.")
    return value


@dataclass(frozen=True)
class CoreScaling:
    """Per core of a layout: the standard deviation of its effective entries at initialisation
    and the forward multiplier of its stored values (a power of two)."""

    stds: tuple[float, ...]
    multipliers: tuple[float, ...]


def power_of_two(x: float) -> float:
    """The power of two nearest to ``x`` (> 0) on a log scale."""
    return 2.0 ** round(math.log2(x))


def core_scaling(layout: Layout) -> CoreScaling:
    """The balanced parametrization of ``layout``: effective stds ``sqrt(g / fan_in_k)`` with
    ``prod(g) = var * in_features``, ``var`` the dense weight's variance (``nn.Linear``'s
    ``1 / (3 * in)``), and multipliers ``std_k / (n * std_dense)``, ``std_dense = sqrt(var)``,
    as powers of two."""
    fans = layout.core_fans()
    n = len(fans)
    var = 1.0 / (3 * layout.in_features)
    g = (var * layout.in_features) ** (1.0 / n)
    stds = tuple(math.sqrt(g / fan_in) for fan_in, _ in fans)
    dense = math.sqrt(var)
    return CoreScaling(stds, tuple(power_of_two(s / (n * dense)) for s in stds))


def structure_aware_multipliers(layout: Layout) -> tuple[float, ...]:
    """Forward multipliers that give core k (at the balanced initial values) the relative Adam
    update of Qiu et al. 2024's structure-aware rate: each core a dense layer of its own fan-in
    and fan-out under muP, its rate ``lr * in_features / (n * fan_in_k)`` at the initial std
    ``min(1, sqrt(fan_out_k / fan_in_k)) / sqrt(fan_in_k)``, each against its own dense layer
    (theirs at muP's std ``1 / sqrt(in)``, ours ``nn.Linear``'s ``1 / sqrt(3 in)``). Against the
    balanced multipliers (every core ``1 / n`` of the dense weight's relative update; here
    unrounded) that is core k's times ``sqrt(in_features / fan_in_k) / min(1, sqrt(fan_out_k /
    fan_in_k))``: larger where a core's fan-in is a smaller share of the layer's, so a layer of
    larger fan-in steps further. Not powers of two: storing a core under them is
    exact only up to rounding."""
    fans = layout.core_fans()
    n, n_in = len(fans), layout.in_features
    return tuple(std * math.sqrt(3) * n_in
                 / (n * math.sqrt(fan_in) * min(1.0, math.sqrt(fan_out / fan_in)))
                 for std, (fan_in, fan_out) in zip(core_scaling(layout).stds, fans, strict=True))


def orthogonal_cores(layout: Layout, scaling: CoreScaling, generator=None,
                     dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> list[Tensor]:
    """Effective cores of ``layout``: each a random semi-orthogonal map from its fan-in indices
    to its fan-out indices, one per value of its block indices, scaled to ``scaling.stds``."""
    cores = []
    for k, (batch, ins, outs) in enumerate(layout.core_roles()):
        shape = layout.core_shapes[k]
        order = [*batch, *ins, *outs]
        nb, ni, no = (math.prod(shape[a] for a in axes) for axes in (batch, ins, outs))
        gauss = torch.randn(nb, max(ni, no), min(ni, no), generator=generator,
                            dtype=torch.float64)
        q, r = torch.linalg.qr(gauss)  # (nb, max, min), orthonormal columns
        q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)  # Haar
        if ni < no:
            q = q.transpose(-2, -1)  # (nb, ni, no): orthonormal rows
        # entries of variance 1 / max(ni, no): scale to the target std
        q = q * (scaling.stds[k] * math.sqrt(max(ni, no)))
        core = q.reshape([shape[a] for a in order]).permute(*[order.index(a)
                                                             for a in range(len(shape))])
        cores.append(core.to(dtype=dtype or torch.get_default_dtype(), device=device))
    return cores


def balance_gauge(cores: Sequence[Tensor], multipliers: Sequence[float]) -> list[Tensor]:
    """The same weight with its scalar gauge spread: core k (as the network reads it) times a
    power of two ``c_k``, ``prod(c_k) = 1`` (exact), so that the stored values
    ``c_k * core_k / multiplier_k`` have root-mean-squares as even as powers of two allow.
    Adam moves a stored entry by about the learning rate, so even stored scales are even
    relative updates. A decomposition (TT-SVD, SVD...) leaves every core orthonormal but the one
    holding the singular values; spread, no core moves far faster than the others."""
    n = len(cores)
    logs = []
    for core, multiplier in zip(cores, multipliers, strict=True):
        rms = float(core.detach().double().pow(2).mean().sqrt()) if core.numel() else 0.0
        if not rms > 0 or not math.isfinite(rms):
            return list(cores)  # a zero or non-finite core: nothing to spread
        logs.append(math.log2(rms / multiplier))
    mean = sum(logs) / n
    wanted = [mean - x for x in logs]
    shifts = [round(w) for w in wanted]
    excess = sum(shifts)  # the product must stay exactly one: undo the roundings that went
    by_error = sorted(range(n), key=lambda k: shifts[k] - wanted[k], reverse=excess > 0)
    for k in by_error[:abs(excess)]:  # furthest in the excess's direction
        shifts[k] -= 1 if excess > 0 else -1
    return [core * (2.0 ** s) if s else core for core, s in zip(cores, shifts, strict=True)]
