"""``allocation="sensitivity"``: each linear layer's ranks chosen from the model's measured loss
when that layer alone is decomposed (ASVD's sensitivity), then the measured floor against
uniform.

Per converted linear layer, a ladder of candidate ranks (:data:`comera.ranks.sensitivity.LADDER`:
the largest uniform max rank of its format within 1/4 .. 4 times the parameters the uniform
allocation gives the layer, on a geometric ladder, at most its dense size, plus the uniform
bonds themselves; equal bonds measured once). For each candidate the layer is decomposed as the
conversion would decompose it (calibrated; refitted with ``closed_form_refit``), that
decomposition's dense weight is written into the *dense* model in place of the layer's weight
(every other layer dense), and the model's loss is measured on the measurement batches
(:func:`comera.surgery.measured_loss.model_loss`); the weight is put back after. So the model is
never swapped during the sweep and any module a converter reads a weight from (Linear, Conv1D,
an attention's projections) is measured the same way. :func:`comera.ranks.sensitivity.
allocate_sensitivity` then spends the budget (the uniform allocation's size at the target, or
``target_size``) where a parameter lowers the summed loss increase most, and
:func:`comera.surgery.measured_floor.keep_lower_` measures the model under those ranks and under
uniform's, keeping the lower: the result never loses to uniform on the measured loss.

Cost, with ``L`` linear layers, ``K_l <= len(LADDER) + 1`` distinct candidates of layer ``l``
and ``B`` measurement batches: at most ``sum_l K_l + 2 L`` decompositions (the sweep's, then
the floor's two candidates, one when they agree) and ``(1 + sum_l K_l + 2) x B`` forward passes
without gradients (the dense model, the sweep, the floor's candidates); memory: one layer's
dense weight copied at a time, and the uniform candidate's cores while the other is measured.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from comera.errors import ConfigError, ConversionError
from comera.formats.registry import get_format
from comera.ranks.budget import largest_rank, layout_size
from comera.ranks.sensitivity import (
    LADDER,
    Candidate,
    LayerSensitivity,
    SensitivityAllocation,
    allocate_sensitivity,
    ladder_sizes,
)
from comera.surgery.config import ConvertConfig
from comera.surgery.converters import Part
from comera.surgery.decompose import check_budget, check_linear, decompose_parts_, uniform_bonds
from comera.surgery.input_statistics import InputStats
from comera.surgery.measured_floor import MeasuredFloor, keep_lower_
from comera.surgery.measured_loss import LossFn, model_loss

log = logging.getLogger("comera.surgery.sensitivity")

__all__ = ["candidate_bonds", "check_sensitivity", "measure_sensitivity", "sensitivity_floor_"]


def check_sensitivity(names: Sequence[str], config: ConvertConfig) -> None:
    """With ``allocation="sensitivity"``, every linear layer to convert is in a format with a
    decomposition (its candidates are decomposed), else a :class:`ConfigError` naming the first
    other one (raised before any work)."""
    if config.allocation != "sensitivity":
        return
    for name in names:
        fmt = get_format(config.format_for(name))
        if not fmt.has_decomposition:
            raise ConfigError(f"allocation='sensitivity' decomposes each layer at candidate "
                              f"ranks; layer {name!r} is in the {fmt.name!r} format, which has "
                              "no decomposition. Choose another format for it, or "
                              "allocation='uniform'.")


def candidate_bonds(part: Part, uniform: Sequence[int],
                    ladder: Sequence[float] = LADDER) -> list[tuple[int, ...]]:
    """The bond sizes of ``part``'s candidates: per size of :func:`ladder_sizes` around its
    uniform share (``uniform``: its bonds under the uniform allocation), the layout of its
    format at the largest uniform max rank within that size (at least rank 1), and ``uniform``
    itself; distinct, cheapest first."""
    fmt, layout = get_format(part.format), part.layer.layout
    modes = (layout.in_modes, layout.out_modes)
    share = layout.parameters_at(uniform)
    found = {tuple(uniform)}
    for size in ladder_sizes(share, layout.in_features * layout.out_features, ladder):
        rank = max(1, largest_rank(lambda r: layout_size(fmt, *modes, r), size))
        found.add(fmt.layout(*modes, rank).bond_sizes)
    return sorted(found, key=lambda b: (layout.parameters_at(b), b))


def _dense_view(model: nn.Module, part: Part) -> Tensor:
    """``part.weight``, checked to be a view of one of ``model``'s parameters (the converters
    read weights as views), so writing it changes what the dense model computes."""
    weight = part.weight
    ptr = weight.untyped_storage().data_ptr()
    if not any(p.untyped_storage().data_ptr() == ptr for p in model.parameters()):
        raise ConversionError(f"allocation='sensitivity': the weight of layer {part.name!r} is "
                              "not held by the model being converted, so its sensitivity cannot "
                              "be measured; use allocation='global' or 'uniform' for it.")
    return weight


def measure_sensitivity(model: nn.Module, parts: Sequence[Part],
                        stats: Mapping[str, InputStats], config: ConvertConfig,
                        batches: Sequence, loss: LossFn | None,
                        uniform: Mapping[str, Sequence[int]]) -> list[LayerSensitivity]:
    """Per linear part, the model's loss on ``batches`` with that part alone replaced by its
    decomposition at each of :func:`candidate_bonds` (see the module docstring). The model's
    weights are as they were on return, whatever happens."""
    out = []
    for p in check_linear(parts, config):
        weight = _dense_view(model, p)
        original = weight.detach().clone()
        candidates = []
        try:
            for bonds in candidate_bonds(p, uniform[p.name]):
                # decomposed from the dense weight (part.weight is the view written below)
                decompose_parts_([p], stats, config, bonds={p.name: bonds})
                with torch.no_grad():
                    approx = p.layer.to_dense().T  # (in, out), as the weight
                    weight.copy_(approx.to(weight.dtype))
                measured = model_loss(model, batches, loss)
                with torch.no_grad():
                    weight.copy_(original)
                # sized at the bonds asked for (a decomposition may find a lower exact rank)
                candidates.append(Candidate(tuple(bonds), p.layout.parameters_at(bonds),
                                            measured))
        finally:
            with torch.no_grad():
                weight.copy_(original)
        out.append(LayerSensitivity(p.name, tuple(candidates), tuple(uniform[p.name])))
        log.info("sensitivity of %s: %s", p.name,
                 ", ".join(f"{list(c.bonds)} ({c.size:,}): {c.loss:.4f}" for c in candidates))
    return out


def sensitivity_floor_(model: nn.Module, built: Sequence[tuple[str, nn.Module]],
                       parts: Sequence[Part], stats: Mapping[str, InputStats],
                       config: ConvertConfig, batches: Sequence, loss: LossFn | None = None,
                       base: float = 0.0) -> tuple[MeasuredFloor, SensitivityAllocation]:
    """Measure every linear part's sensitivity, allocate the budget by it, then keep the lower
    of its and the uniform allocation's measured loss (see the module docstring); ``base``: the
    dense model's loss on ``batches``. The parts' layers are left decomposed at the ranks kept;
    ``model`` is unchanged on return."""
    linear = check_linear(parts, config)
    uniform = uniform_bonds(linear, config)
    budget = check_budget(linear, config)
    layers = measure_sensitivity(model, linear, stats, config, batches, loss, uniform)
    allocation = allocate_sensitivity(layers, budget, base)
    log.info("sensitivity allocation: %s", allocation)
    floor = keep_lower_(model, built, parts, stats, config, batches, loss, uniform,
                        ("sensitivity", allocation.ranks))
    return floor, allocation
