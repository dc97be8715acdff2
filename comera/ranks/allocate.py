"""Rank allocation from the spectrum: one global size budget, spent where the singular values are.

Every bond of a TT layer has singular values: those of the layer's weight unfolded at that bond
(computed exactly by a QR sweep left to right and an SVD sweep right to left, as TT rounding
does). Cutting a bond to rank r discards the energy of its singular values past r, and the TT
error is at most the root of the discarded energies summed over bonds. So, given a size budget,
:func:`allocate` keeps the slices with the most energy per parameter, across all layers and
bonds at once: starting from a floor (by default the uniform allocation, the largest uniform
rank whose model fits the budget), it adds one slice at a time, the one whose share of its
layer's energy (``sigma^2 / ||W||^2``) per parameter it costs is largest, until no slice fits.
That spend is the one rank allocator's (:func:`comera.ranks.global_budget.allocate_budget`,
rule ``"energy_share"``, from the floor, one slice at a time, no dense limit), which
``convert_``'s global allocation also calls (rule ``"squared_error"``). A slice's cost is what
the two cores around its bond grow by (``n_k r_{k-1} + n_{k+1} r_{k+1}``), so it changes as the
neighbours grow, and a bond never exceeds what its neighbours allow (``r_k <= r_{k-1} n_k`` and
``r_k <= n_{k+1} r_{k+1}``).

Starting from the uniform allocation means the result holds every slice the fixed uniform rank
would: the allocation only spends the budget the uniform rank leaves unused (a uniform rank
jumps in steps: at rank 1 -> 2 the reviews model's linear layers go from 145x to 108x), and
where the spectra say a bond carries nothing past a rank, the uniform floor is cut there too.

:func:`allocate_` applies an allocation exactly: each layer is rounded
(:func:`comera.ranks.truncate.round_layer_`, which leaves every bond's slices in the order of
its singular values) and the gates past the allocated ranks are zeroed, so truncation
(:func:`comera.ranks.truncate.truncate_`) then drops them. Used at the start of the late stage
(``LateStage(allocation="spectrum")``; the default is ``"prune"``): decide the shape once, then
train it.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from comera.errors import ConfigError, NonFiniteError
from comera.formats.registry import get_format
from comera.layers.linear import GatedLayer, GatedLinear
from comera.ranks.budget import largest_rank
from comera.ranks.global_budget import LayerSpectra, allocate_budget
from comera.ranks.size import gated_layers, model_size
from comera.ranks.truncate import live_cores, rebuild_stacks, round_layer_, rounds_exactly

log = logging.getLogger("comera.ranks.allocate")

FLOORS = ("uniform", "one")

__all__ = [
    "FLOORS",
    "Allocation",
    "RankOneWarning",
    "allocate",
    "allocate_",
    "bond_spectra",
    "layer_size",
    "rank_one_layers",
    "spectrum_applies",
    "uniform_ranks",
    "warn_rank_one",
]


class RankOneWarning(UserWarning):
    """A size budget left some TT layer at rank 1 on every bond (a rank-1 weight: every input
    maps onto one direction)."""


def _inner(layer: GatedLayer) -> list[int]:
    return [math.prod(c.shape[1:-1]) for c in layer.cores]


_CHAINS_ONLY = ("spectrum allocation needs tensor-train chains (tt, ttm) with an exact "
                "rounding. Use allocation=\"prune\" (LateStage(allocation=\"prune\"), the "
                "default), which works for every format.")


def check_chains(layers) -> None:
    """Spectrum allocation reads a chain's bond spectra and rounds it exactly: every layer must
    be a chain (TT, TT-matrix) whose format rounds, else a :class:`ConfigError` naming the
    first other layer and the fix."""
    for name, layer in layers:
        if not (layer.layout.is_chain and rounds_exactly(layer)):
            raise ConfigError(f"layer {name or '<model>'} is in the {layer.format.name!r} "
                              f"format; {_CHAINS_ONLY}")


def spectrum_applies(layers) -> bool:
    """Whether the spectrum allocation can shape ``layers`` ((name, gated layer) pairs): there is
    at least one and every one is a chain whose format rounds exactly (what
    :func:`check_chains` asks)."""
    layers = list(layers)
    return bool(layers) and all(layer.layout.is_chain and rounds_exactly(layer)
                                for _, layer in layers)


def check_chain_format(name: str, what: str = "format") -> None:
    """:func:`check_chains` for the layers a registered format ``name`` builds from modes, read
    from the format before any is built (its layout at small modes and rank 2)."""
    fmt = get_format(name)
    modes = (2, 2) if fmt.uses_modes else (4,)
    if not (fmt.layout(modes, modes, 2).is_chain and rounds_exactly(fmt)):
        raise ConfigError(f"{what}={name!r}: {_CHAINS_ONLY}")


def layer_size(layer: GatedLayer, ranks) -> int:
    """Parameters of a chain ``layer`` at bond sizes ``ranks`` (ends included), bias
    included."""
    bias = layer.bias.numel() if layer.bias is not None else 0
    return bias + layer.layout.parameters_at(tuple(ranks[1:-1]))


def bond_spectra(layer: GatedLayer, rtol: float = 1e-10, name: str = "") -> tuple[Tensor, ...]:
    """Per bond (gate order), the singular values of ``layer``'s weight unfolded at that bond
    (live slices, gates folded in; float64, descending; values below ``rtol`` times the
    largest dropped). Read only: the layer is not changed. A core or gate holding NaN or
    infinity is a :class:`NonFiniteError` naming the layer (``name``)."""
    check_chains([(name, layer)])
    if layer.is_removed():
        return tuple(torch.zeros(0, dtype=torch.float64) for _ in layer.gates)
    with torch.no_grad():
        cores = [c.reshape(c.shape[0], -1, c.shape[-1])  # (r_{k-1}, n_k, r_k)
                 for c in live_cores(layer)]
        if not all(bool(torch.isfinite(c).all()) for c in cores):
            raise NonFiniteError(f"layer {name or '<model>'}: its cores (gates folded in) hold "
                                 "NaN or infinite values, so its bond spectra do not exist. "
                                 "Resume from a checkpoint before the divergence (or lower the "
                                 "learning rate) before a spectrum allocation.")
        n = len(cores)
        for k in range(n - 1):  # left to right: QR, so the left part is orthonormal
            r0, m, r1 = cores[k].shape
            q, r = torch.linalg.qr(cores[k].reshape(r0 * m, r1))
            cores[k] = q.reshape(r0, m, q.shape[1])
            cores[k + 1] = torch.tensordot(r, cores[k + 1], dims=1)
        spectra: list[Tensor] = [torch.zeros(0)] * (n - 1)
        for k in range(n - 1, 0, -1):  # right to left: SVD of each bond's unfolding
            r0, m, r1 = cores[k].shape
            u, s, vh = torch.linalg.svd(cores[k].reshape(r0, m * r1), full_matrices=False)
            keep = int((s > rtol * s[0]).sum()) if s.numel() and s[0] > 0 else 0
            spectra[k - 1] = s[:keep].clone()
            cores[k] = vh.reshape(-1, m, r1)
            cores[k - 1] = torch.tensordot(cores[k - 1], u * s, dims=1)
    return tuple(spectra)


def _capped(ranks: list[int], inner: list[int], avail: list[int]) -> list[int]:
    """``ranks`` (ends included) cut to what each bond carries (``avail``) and its neighbours
    allow, both ways."""
    out = list(ranks)
    for k in range(1, len(out) - 1):
        out[k] = max(1, min(out[k], avail[k - 1], out[k - 1] * inner[k - 1]))
    for k in range(len(out) - 2, 0, -1):
        out[k] = max(1, min(out[k], inner[k] * out[k + 1]))
    return out


@dataclass(frozen=True)
class Allocation:
    """Bond sizes (ends included) per TT layer, the model's size at them, the budget, and the
    uniform rank (the largest whose model fits the budget; 0 when not even rank 1 does)."""

    ranks: dict[str, tuple[int, ...]]
    size: int
    budget: float
    uniform_rank: int
    uniform: dict[str, tuple[int, ...]]

    def __str__(self) -> str:
        rows = [f"{name or '<model>'}: {self.ranks[name][1:-1]} (uniform "
                f"{self.uniform[name][1:-1]})" for name in self.ranks]
        return "\n".join([f"size {self.size} of {self.budget:.0f} (uniform rank "
                          f"{self.uniform_rank})", *rows])


def uniform_ranks(model: nn.Module, target_size: float,
                  limit: int | None = None) -> tuple[int, dict[str, tuple[int, ...]]]:
    """The largest uniform rank r whose model fits ``target_size`` (every bond at ``min(r, what
    it carries now and its neighbours allow)``; :func:`comera.ranks.budget.largest_rank`), and
    those ranks per layer; (0, rank 1 ranks) when not even rank 1 fits. ``limit``: the highest
    rank tried (default: the largest bond)."""
    layers = [(name, m) for name, m in gated_layers(model) if not m.is_removed()]
    check_chains(layers)
    other = model_size(model) - sum(m.num_parameters() for _, m in layers)
    top = limit or max((max(m.ranks) for _, m in layers), default=1)

    def at(r: int) -> dict[str, tuple[int, ...]]:
        out = {}
        for name, m in layers:
            cur = list(m.ranks)
            out[name] = tuple(_capped([1] + [r] * (len(cur) - 2) + [1], _inner(m), cur[1:-1]))
        return out

    def size(r: int) -> int:
        ranks = at(r)
        return other + sum(layer_size(m, ranks[name]) for name, m in layers)

    best = largest_rank(size, target_size, top)
    return best, at(max(best, 1))


def allocate(model: nn.Module, target_size: float, floor: str = "uniform",
             min_rank: int = 1) -> Allocation:
    """The bond sizes that keep the most spectral energy per parameter within ``target_size``
    (the whole model's parameters, as :func:`comera.ranks.size.model_size` counts them); see the
    module docstring. ``floor``: ``"uniform"`` starts from the uniform allocation, ``"one"``
    from rank 1 everywhere; ``min_rank`` raises that floor on every bond (to what the bond
    carries). No layer is removed: every bond keeps at least one slice. A budget below the
    floor's size gives the floor (``size`` then exceeds ``budget``)."""
    if floor not in FLOORS:
        raise ConfigError(f"floor={floor!r}; choose one of {', '.join(FLOORS)}.")
    if not target_size > 0:
        raise ConfigError(f"target_size={target_size}; it must be > 0 parameters.")
    layers = [(name, m) for name, m in gated_layers(model) if not m.is_removed()]
    if not layers:
        raise ConfigError("the model has no live TT layers: convert it with comera.convert_ "
                          "first.")
    check_chains(layers)
    other = model_size(model) - sum(m.num_parameters() for _, m in layers)
    u_rank, uniform = uniform_ranks(model, target_size)
    spectra, starts = [], {}
    for name, m in layers:
        bonds = bond_spectra(m, name=name)
        avail = [max(1, s.numel()) for s in bonds]
        start = uniform[name] if floor == "uniform" and u_rank > 0 else (1,) * len(m.ranks)
        start = [1, *(max(r, min_rank) for r in start[1:-1]), 1]
        starts[name] = tuple(_capped(start, _inner(m), avail)[1:-1])
        spectra.append(LayerSpectra(name, m.layout, bonds))
    fixed = other + sum(m.bias.numel() for _, m in layers if m.bias is not None)
    spent = allocate_budget(spectra, target_size - fixed, rule="energy_share", start=starts,
                            pairs=False, dense_limit=False)
    ranks = {name: (1, *spent.ranks[name], 1) for name, _ in layers}
    size = other + sum(layer_size(m, ranks[name]) for name, m in layers)
    return Allocation(ranks, int(size), float(target_size), u_rank,
                      {name: uniform[name] for name, _ in layers})


def rank_one_layers(model: nn.Module) -> list[str]:
    """Names of the live TT layers whose every bond is at rank 1."""
    return [name for name, m in gated_layers(model)
            if not m.is_removed() and all(r == 1 for r in m.ranks)]


def warn_rank_one(model: nn.Module, why: str) -> list[str]:
    """Warn (:class:`RankOneWarning`) naming the layers left at rank 1 on every bond."""
    names = rank_one_layers(model)
    if names:
        warnings.warn(f"{why} leaves {len(names)} TT layer(s) at rank 1 on every bond "
                      f"({', '.join(n or '<model>' for n in names[:6])}"
                      f"{' ...' if len(names) > 6 else ''}): a rank-1 weight maps every input "
                      "onto one direction; raise the size target or compress fewer layers.",
                      RankOneWarning, stacklevel=3)
    return names


def allocate_(model: nn.Module, target_size: float, optimizer=None,
              floor: str = "uniform", min_rank: int = 1) -> Allocation:
    """Compute :func:`allocate` and apply it in place: every layer rounded (exact) and its gates
    past the allocated ranks zeroed (the slices of least energy), so the model's size is the
    allocation's. ``optimizer``: the rounded layers' moments are reset as
    :func:`comera.ranks.truncate.round_layer_` does. Warns (:class:`RankOneWarning`) when a layer
    ends at rank 1 on every bond."""
    allocation = allocate(model, target_size, floor, min_rank)
    with torch.no_grad():
        for name, layer in gated_layers(model):
            if name not in allocation.ranks:
                continue
            round_layer_(layer, optimizer)
            for k, gate in enumerate(layer.gates):
                keep = allocation.ranks[name][k + 1]
                if int((gate.abs() > layer.tau).sum()) > keep:
                    gate[keep:] = 0.0
            layer.build_compiled()
    rebuild_stacks(model)
    log.info("allocation: %s", allocation)
    warn_rank_one(model, f"the size budget {target_size:.0f}")
    return allocation


def rebuild_at_(model: nn.Module, ranks: dict[str, tuple[int, ...]]) -> nn.Module:
    """Replace each TT layer named in ``ranks`` by a freshly initialised layer of the same type,
    modes, bias and tau at those bond sizes (ends included), drawn from the current RNG: decide
    the shape on a briefly trained model (:func:`allocate`), then train that shape from the
    start, as a fixed-rank model is trained. Returns ``model``."""
    layers = dict(gated_layers(model))
    missing = sorted(set(ranks) - set(layers))
    if missing:
        raise ConfigError(f"ranks name {missing[:4]}, not TT layers of the model (it has "
                          f"{sorted(layers)[:4]} ...); pass an allocation of this model.")
    for name, bonds in ranks.items():
        layer = layers[name]
        if not isinstance(layer, GatedLinear):
            raise ConfigError(f"layer {name or '<model>'} is a {type(layer).__name__}; "
                              "rebuild_at_ rebuilds linear layers (GatedLinear, TTLinear, "
                              "TTMLinear) only.")
        sizes = bonds[1:-1] if layer.layout.is_chain else bonds
        layout = layer.layout.resized(dict(zip(layer.layout.bonds, sizes, strict=True)))
        fresh = type(layer).from_layout(layout, layer.format, bias=layer.bias is not None,
                                        tau=layer.tau, dtype=layer.cores[0].dtype,
                                        device=layer.cores[0].device)
        fresh.compile_options = dict(layer.compile_options)
        fresh.build_compiled()
        if name:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, fresh)
        else:
            raise ConfigError("the model is itself a TT layer: build a new one at the ranks.")
    rebuild_stacks(model)
    return model
