"""The decomposition pass of ``convert_``: each converted linear layer decomposed once from its
dense weight, calibrated on its inputs and at the ranks one global budget gives it.

The converters build every gated layer at the config's uniform rank and leave its cores to
:func:`decompose_parts_`, which decomposes each linear part once from the dense weight it was
made from: the bond sizes come from :func:`comera.ranks.global_budget.allocate_budget` over every
part's (whitened) bond spectra (``allocation="global"``; the uniform allocation's bonds,
:func:`uniform_bonds`, come back where the greedy spend's estimated error is not lower) or stay
the layer's own, and the cores from the format's calibrated decomposition
(:mod:`comera.formats.whitened`) where the part has statistics (``calibration=``) and the format
calibrates, else its plain one; with ``closed_form_refit`` the output-side cores of a layer with
statistics are then solved in closed form (:func:`comera.formats.whitened.refit_output_cores`).
``floor="measured"`` asks :func:`candidate_ranks` for both allocations' bonds and decomposes at
each in turn (``decompose_parts_(..., bonds=...)``); ``convert_`` measures the loss. Nothing
here touches the model: ``convert_`` swaps the layers in
only after this pass has succeeded, so a budget no allocation can meet leaves the model as it
was.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from comera.errors import ConfigError
from comera.formats.registry import Format, format_names, get_format
from comera.formats.whitened import damped, output_error, refit_output_cores
from comera.layers.linear import load_cores_
from comera.ranks.budget import largest_rank
from comera.ranks.global_budget import (
    BudgetAllocation,
    LayerSpectra,
    allocate_budget,
    floor_size,
)
from comera.surgery.config import ConvertConfig
from comera.surgery.converters import Part
from comera.surgery.input_statistics import InputStats

log = logging.getLogger("comera.surgery.decompose")

__all__ = ["allocate_parts", "candidate_ranks", "check_budget", "check_global", "check_linear",
           "decompose_parts_", "has_spectra", "layer_errors", "redecompose_", "uniform_bonds"]


def has_spectra(fmt: Format) -> bool:
    """Whether ``fmt`` reports bond spectra (global allocation needs them):
    :attr:`Format.has_spectra`."""
    return fmt.has_spectra


def check_global(names: Sequence[str], config: ConvertConfig) -> None:
    """With ``allocation="global"``, every linear layer to convert is in a format with bond
    spectra, else a :class:`ConfigError` naming the first other one (raised before any work)."""
    if config.allocation != "global":
        return
    for name in names:
        fmt = get_format(config.format_for(name))
        if not has_spectra(fmt):
            with_spectra = [n for n in format_names() if has_spectra(get_format(n))]
            raise ConfigError(f"allocation='global' reads each layer's bond spectra; layer "
                              f"{name!r} is in the {fmt.name!r} format, which has none. Use "
                              f"one of {', '.join(with_spectra)} for it, or "
                              "allocation='uniform'.")


def _gram(part: Part, stats: Mapping[str, InputStats], config: ConvertConfig) -> Tensor | None:
    """The damped gram of ``part`` when it has statistics and its format calibrates (a copy made
    when needed: one layer's at a time, not a second set of every layer's)."""
    if part.name not in stats or not get_format(part.format).calibrates:
        return None
    return damped(stats[part.name].moments, config.damping)  # scale-free: moments will do


def check_budget(parts: Sequence[Part], config: ConvertConfig) -> float:
    """The global allocation's budget over the linear ``parts`` (``target_size``, or their dense
    size / target_compression less their biases, so that layers with biases land on the target
    as the uniform allocation does), else a :class:`ConfigError` when not even every bond at
    rank 1 fits it, naming the largest target that does. Needs only the layouts: raised before
    calibration."""
    floor = floor_size([LayerSpectra(p.name, p.layer.layout, tuple(
        torch.ones(1, dtype=torch.float64) for _ in p.layer.layout.bonds)) for p in parts])
    biases = sum(p.bias.numel() for p in parts if p.bias is not None)
    dense = sum(p.weight.numel() for p in parts) + biases
    if config.target_size is not None:
        budget = float(config.target_size)
        if floor > budget:
            raise ConfigError(f"target_size={config.target_size:,} cannot be met: the "
                              f"{len(parts)} linear layers need {floor:,} parameters with every "
                              f"bond at rank 1; set target_size >= {floor:,} (or convert fewer "
                              "layers).")
        return budget
    budget = dense / config.target_compression - biases
    if floor > budget:
        raise ConfigError(f"target_compression={config.target_compression:g} cannot be met: the "
                          f"{len(parts)} linear layers need {floor:,} parameters (and {biases:,} "
                          f"bias entries) with every bond at rank 1; the largest target they "
                          f"reach is {dense / (floor + biases):.4g}. Lower target_compression, "
                          "or convert fewer layers.")
    return budget


def uniform_bonds(parts: Sequence[Part], config: ConvertConfig) -> dict[str, tuple[int, ...]]:
    """The bond sizes the uniform allocation gives ``parts`` at the global budget: with
    target_compression, the layers as the converters built them (each at the largest uniform
    rank within its own dense size / target); with target_size, the largest rank shared by all
    whose layers fit it together."""
    if config.target_size is None:
        return {p.name: p.layer.layout.bond_sizes for p in parts}

    def at(rank: int) -> dict[str, tuple[int, ...]]:
        return {p.name: get_format(p.format).layout(p.layer.layout.in_modes,
                                                    p.layer.layout.out_modes, rank).bond_sizes
                for p in parts}

    def size(rank: int) -> int:
        bonds = at(rank)
        return sum(p.layer.layout.parameters_at(bonds[p.name]) for p in parts)

    return at(max(1, largest_rank(size, config.target_size)))


def allocate_parts(parts: Sequence[Part], stats: Mapping[str, InputStats],
                   config: ConvertConfig) -> BudgetAllocation:
    """One budget over ``parts`` (:func:`check_budget`), spent on the bond slices of most
    (whitened, where statistics are given) energy per parameter, or the uniform allocation's
    bonds where its estimated error is not higher (:func:`allocate_budget`)."""
    allocation = allocate_budget(_spectra(parts, stats, config), check_budget(parts, config),
                                 uniform_bonds(parts, config))
    log.info("global allocation: %s", allocation)
    return allocation


def candidate_ranks(parts: Sequence[Part], stats: Mapping[str, InputStats], config: ConvertConfig
                    ) -> tuple[BudgetAllocation, dict[str, tuple[int, ...]]]:
    """The global spend's own allocation over ``parts`` (no floor: nothing replaced by the
    uniform ranks) and the uniform allocation's bonds at the same budget: the two candidates
    ``floor="measured"`` measures."""
    allocation = allocate_budget(_spectra(parts, stats, config), check_budget(parts, config))
    log.info("global allocation (a candidate): %s", allocation)
    return allocation, uniform_bonds(parts, config)


def _spectra(parts: Sequence[Part], stats: Mapping[str, InputStats],
             config: ConvertConfig) -> list[LayerSpectra]:
    """Each part's bond spectra: of its whitened weight where it is calibrated."""
    layers = []
    for p in parts:
        fmt, layout = get_format(p.format), p.layer.layout
        spectra = fmt.spectra(p.weight.detach().to(torch.float64), layout,
                              _gram(p, stats, config))
        layers.append(LayerSpectra(p.name, layout, tuple(spectra)))
    return layers


def check_linear(parts: Sequence[Part], config: ConvertConfig) -> list[Part]:
    """The linear parts of ``parts``; a :class:`ConfigError` when a global allocation has none
    to spend its budget over."""
    linear = [p for p in parts if p.weight is not None]
    if config.allocation == "global" and not linear:
        raise ConfigError("allocation='global' spends its budget over linear layers, and none "
                          "is converted; use allocation='uniform' for embedding tables.")
    return linear


def decompose_parts_(parts: Sequence[Part], stats: Mapping[str, InputStats],
                     config: ConvertConfig,
                     bonds: Mapping[str, Sequence[int]] | None = None) -> BudgetAllocation | None:
    """Decompose the linear parts (see the module docstring), in place on the parts' layers,
    each once: with a global allocation every one at its allocated bonds (``bonds``: at these
    instead, no allocation made); those with statistics and a calibrating format calibrated,
    the others by the format's plain decomposition; with ``closed_form_refit``, those with
    statistics then refitted. Returns the global allocation, if any was made. Raises
    :class:`ConfigError` (a budget no allocation meets) before any layer changes."""
    linear = check_linear(parts, config)
    allocation = None
    if bonds is None and config.allocation == "global":
        allocation = allocate_parts(linear, stats, config)
        bonds = allocation.ranks
    for p in linear:
        layer, fmt, gram = p.layer, get_format(p.format), _gram(p, stats, config)
        if bonds is not None:
            layer.resize_bonds_(bonds[p.name])
        if config.closed_form_refit and p.name in stats:
            cores = (fmt.decompose(p.weight, layer.layout) if gram is None
                     else fmt.decompose(p.weight, layer.layout, gram))
            if cores is not None:
                cores = refit_output_cores(cores, layer.layout, p.weight,
                                           stats[p.name].moments)
                load_cores_(layer, cores, p.bias)
                continue
        if gram is None:
            layer.load_weight_(p.weight, p.bias)  # plain (or the bias alone: no decomposition)
            continue
        load_cores_(layer, fmt.decompose(p.weight, layer.layout, gram), p.bias)
    return allocation


redecompose_ = decompose_parts_  # the name convert_ calls it by


def layer_errors(parts: Sequence[Part], stats: Mapping[str, InputStats]) -> dict[str, float]:
    """Per linear part, its relative error: of the output on the calibration inputs
    (``sqrt(tr(E^T C E) / tr(W^T C W))``, the undamped C) where it has statistics, else of the
    weight (``||W - Ŵ|| / ||W||``)."""
    out = {}
    with torch.no_grad():
        for p in parts:
            if p.weight is None:
                continue
            w = p.weight.detach().to(torch.float64)
            approx = p.layer.to_dense().T.to(torch.float64)  # (in, out), as w
            if p.name in stats:
                gram = stats[p.name].moments  # the ratio below is free of its scale
                scale = output_error(w, torch.zeros_like(w), gram)
                out[p.name] = output_error(w, approx, gram) / scale if scale > 0 else 0.0
            else:
                norm = float(w.norm())
                out[p.name] = float((w - approx).norm()) / norm if norm > 0 else 0.0
            if not math.isfinite(out[p.name]):
                raise ConfigError(f"layer {p.name!r}: its decomposition is not finite; check "
                                  "its weights and calibration inputs.")
    return out
