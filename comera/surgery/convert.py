"""Convert an existing torch model in place: matching nn.Linear / nn.Embedding -> TT layers.

As in PEFT: validate the config, match modules by qualified name and type, replace each match
with a TT layer initialised by TT-SVD of its trained weight, and return a report. When nothing
matches, the error lists the modules that were searched.

Besides ``nn.Linear`` and ``nn.Embedding`` it converts HuggingFace's ``Conv1D`` (GPT-2; its weight
is stored transposed) and ``nn.MultiheadAttention``, which becomes a
:class:`~comera.layers.attention.TTMultiheadAttention` (q/k/v projections as three TT layers, or one
with 3x outputs, and ``out_proj``). The eval fast paths of ``nn.TransformerEncoderLayer`` /
``nn.TransformerEncoder`` read dense weights, so they are switched off where a layer was converted.
A layer whose weight is tied to another module (GPT-2's ``lm_head`` shares ``wte``'s table) is
left dense and listed in the report as skipped: converting it would silently untie the two.

``calibration=batches`` (any iterable of model inputs) first streams every converted layer's
input statistics (:mod:`comera.surgery.input_statistics`: one per distinct input, within
``ConvertConfig.statistics_memory``), and the linear layers are decomposed to minimise the error
of their outputs on those inputs; ``ConvertConfig(allocation="global")`` spends one size budget
across all the linear layers, or keeps the uniform allocation's ranks where its estimate is not
lower (:mod:`comera.surgery.decompose`), or, with ``floor="measured"``, where the converted
model's loss on measurement batches is not lower (:mod:`comera.surgery.measured_floor`);
``allocation="sensitivity"`` spends it by the loss measured with each layer alone decomposed
at candidate ranks, then keeps uniform's where that is lower (:mod:`comera.surgery.sensitivity`).
Every
refusal (bad config or a misspelled option, a
target no rank reaches under either allocation, empty calibration, batches the model rejects,
statistics over the memory limit) comes before the first layer is swapped: on error the model is
unchanged.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from comera.errors import ConfigError, ConversionError
from comera.formats.registry import get_format
from comera.layers.linear import check_finite_weight
from comera.surgery.config import BUDGETED, ConvertConfig, check_options
from comera.surgery.converters import (
    CONVERTERS,
    IN_PARTS,
    Converter,
    Part,
    converter_for,
    full_rank,
)
from comera.surgery.decompose import check_budget, check_global, decompose_parts_, layer_errors
from comera.surgery.input_statistics import (
    InputStats,
    check_batches,
    collect_input_stats,
    statistics_bytes,
)
from comera.surgery.measured_floor import measured_floor_
from comera.surgery.measured_loss import LossFn, model_loss
from comera.surgery.sensitivity import check_sensitivity, sensitivity_floor_
from comera.surgery.swap import check_module, fast_paths_off_, swap_submodule
from comera.surgery.table import text_table

__all__ = ["HF_SAVE_WARNING", "ConversionReport", "LayerReport", "convert_"]

HF_SAVE_WARNING = (
    "converted a HuggingFace model: its own save_pretrained does not keep the TT layers, and "
    "from_pretrained of that folder returns dense layers with fresh random weights. Save with "
    "comera.save_pretrained(model, folder) and load with comera.from_pretrained(folder, cls).")


@dataclass(frozen=True)
class LayerReport:
    """One converted layer: name, type, format, dense shape, modes, ranks and parameters
    before/after; ``error``: a linear layer's relative error, of its output on the calibration
    inputs when it has some (``calibrated``), else of its weight."""

    name: str
    kind: str
    shape: tuple[int, int]
    modes: tuple[tuple[int, ...], tuple[int, ...]]
    ranks: tuple[int, ...]
    before: int
    after: int
    format: str = "tt"
    error: float | None = None
    calibrated: bool = False


@dataclass(frozen=True)
class ConversionReport:
    """Per converted layer: shapes, modes, ranks and parameters before/after; ``skipped``: the
    matching layers left dense because their weight is tied to another module."""

    layers: tuple[LayerReport, ...]
    skipped: tuple[str, ...] = ()
    #: calibration batches seen (0: no calibration) and the allocation ("uniform", "global",
    #: "sensitivity")
    batches: int = 0
    allocation: str = "uniform"
    #: with allocation="global" or "sensitivity", whose ranks were kept: that allocation's, or
    #: "uniform" where its estimated error (global's estimate floor) or measured loss (the
    #: measured floor) was not lower (see comera.ranks.global_budget, comera.surgery.sensitivity)
    kept: str = ""
    #: bytes the calibration's input statistics held (one per distinct layer input)
    statistics_bytes: int = 0
    #: with floor="measured": the model's loss on the measurement batches, dense and under
    #: each candidate's ranks ("dense", "uniform", and "global" or "sensitivity"), and the
    #: number of those batches
    losses: tuple[tuple[str, float], ...] = ()
    measured_batches: int = 0

    @property
    def before(self) -> int:
        """Parameters of the converted layers before conversion (dense)."""
        return sum(r.before for r in self.layers)

    @property
    def after(self) -> int:
        """Parameters of the converted layers after conversion (gated)."""
        return sum(r.after for r in self.layers)

    def __str__(self) -> str:
        head = ("layer", "type", "format", "shape", "modes", "ranks", "params", "new params",
                "ratio", "output err" if self.batches else "weight err")
        rows = [(r.name, r.kind, r.format, f"{r.shape[0]}x{r.shape[1]}",
                 f"{list(r.modes[0])}x{list(r.modes[1])}", str(list(r.ranks)), f"{r.before:,}",
                 f"{r.after:,}", f"{r.before / max(r.after, 1):.1f}x",
                 _error_text(r, self.batches > 0)) for r in self.layers]
        rows.append(("total", "", "", "", "", "", f"{self.before:,}", f"{self.after:,}",
                     f"{self.before / max(self.after, 1):.1f}x", ""))
        lines = text_table(head, rows)
        if self.batches:
            lines.append(f"output err: each layer's relative output error on the {self.batches} "
                         "calibration batch(es) (*: no input reached it: weight error)")
        if self.losses:
            lines.append(self._measured_text())
        elif self.allocation == "global" and self.kept == "uniform":
            lines.append("ranks: the uniform allocation's (allocation='global' estimated no "
                         "lower error at this budget)")
        elif self.allocation == "global":
            lines.append("ranks: one size budget spent across the layers (allocation='global')")
        if self.statistics_bytes:
            lines.append(f"calibration statistics: {self.statistics_bytes / 2**20:.1f} MiB")
        if self.skipped:
            lines.append(f"left dense (weight tied to another module): {', '.join(self.skipped)}")
        return "\n".join(lines)


    def _measured_text(self) -> str:
        losses = dict(self.losses)
        kept = self.kept
        other = next(k for k in losses if k not in ("dense", kept))
        return (f"ranks: the {kept} allocation's (floor='measured': loss {losses[kept]:.4f} "
                f"against {losses[other]:.4f} under the {other} allocation's, dense "
                f"{losses['dense']:.4f}, on {self.measured_batches} measurement batch(es))")


def _error_text(r: LayerReport, calibrating: bool) -> str:
    if r.error is None:
        return "-"
    return f"{r.error:.4f}" + ("*" if calibrating and not r.calibrated else "")

def _matches(name: str, config: ConvertConfig) -> bool:
    return (any(fnmatch.fnmatchcase(name, p) for p in config.include)
            and not any(fnmatch.fnmatchcase(name, p) for p in config.exclude))


def _check_finite(chosen: list[tuple[str, nn.Module, Converter]], tied: set[str]) -> None:
    """Every module to convert has finite weights, checked before the first swap, so a bad one
    leaves the model as it was; the error names the module."""
    for name, module, _ in chosen:
        if name in tied:
            continue
        for pname, param in module.named_parameters(recurse=False):
            try:
                check_finite_weight(module, param)
            except ConversionError as exc:
                raise ConversionError(f"{name}.{pname}: {exc}") from None


def _tied(model: nn.Module, chosen: list[tuple[str, nn.Module, Converter]]) -> set[str]:
    """Names of chosen modules whose weight another module of ``model`` also holds."""
    owners: dict[int, set[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(name)
    return {name for name, module, _ in chosen
            if isinstance(getattr(module, "weight", None), nn.Parameter)
            and len(owners.get(id(module.weight), ())) > 1}


def _layer_report(part: Part, errors: dict[str, float],
                  stats: dict[str, InputStats]) -> LayerReport:
    layer = part.layer
    return LayerReport(part.name, type(layer).__name__, part.shape,
                       (part.layout.in_modes, part.layout.out_modes), layer.ranks, part.before,
                       layer.num_parameters(effective=True), part.format,
                       errors.get(part.name), part.name in stats)


def _warn_oversized(parts: list[Part], config: ConvertConfig) -> None:
    """One warning naming the layers whose requested rank reaches their format's full rank
    (the bonds are clipped there) or whose gated form holds more parameters than the dense
    layer."""
    full, larger = [], []
    for part in parts:
        rank = config.rank_for(part.name)
        cap = full_rank(get_format(part.format), part.layout, rank)
        if cap is not None:
            full.append(f"{part.name} ({part.format} rank {rank} >= full {cap})")
        after = part.layer.num_parameters(effective=True)
        if after > part.before:
            larger.append(f"{part.name} ({part.before / max(after, 1):.2f}x)")
    if not (full or larger):
        return
    messages = []
    if full:
        messages.append(f"the requested rank reaches the full rank of {len(full)} layer(s): "
                        f"{_names(full)} (bonds are clipped there: the layer is exact and "
                        "compresses nothing)")
    if larger:
        messages.append(f"compression below 1x (more parameters than dense) for {len(larger)} "
                        f"layer(s): {_names(larger)}")
    warnings.warn("convert_: " + "; ".join(messages) + ". Lower ranks (or set "
                  "target_compression) so the gated layers are smaller than the dense ones.",
                  UserWarning, stacklevel=3)


def _refuse_out_of_reach(parts: list[Part], target: float) -> None:
    """A :class:`ConfigError` naming the layers that hold more than dense / target parameters
    (biases counted on both sides) at rank 1 (the smallest their format has), and the largest
    target every layer reaches: a uniform allocation refuses an unreachable target, as the
    global one does, rather than build rank-1 layers that miss it."""
    over, reach = [], []
    for p in parts:
        layout, bias = p.layer.layout, p.layer.bias
        after = (layout.parameters_at((1,) * len(layout.bonds))
                 + (bias.numel() if bias is not None else 0))
        reach.append(p.before / after)
        if after > p.before / target:
            over.append(f"{p.name} ({p.format}: {p.before / after:.2f}x)")
    if over:
        raise ConfigError(f"target_compression={target:g} cannot be reached: {len(over)} "
                          f"layer(s) compress less even at rank 1: {_names(over)}; the largest "
                          f"target every layer reaches is {min(reach):.4g}. Lower "
                          "target_compression, choose modes or a format that factor them "
                          "further, or leave them dense with exclude=[...].")


def _names(items: list[str], most: int = 6) -> str:
    more = f" and {len(items) - most} more" if len(items) > most else ""
    return ", ".join(items[:most]) + more


def _candidates(model: nn.Module, converters: tuple[Converter, ...]):
    """(name, module, converter) of every module a converter matches, outside the modules
    another converter replaces whole (an nn.MultiheadAttention's out_proj goes with it)."""
    found, owners = [], []
    for name, module in model.named_modules():
        if not name or any(name.startswith(owner + ".") for owner in owners):
            continue
        converter = converter_for(module, converters)
        if converter is not None:
            found.append((name, module, converter))
            owners.append(name)
    return found


def _linear_parts(chosen: list[tuple[str, nn.Module, Converter]],
                  config: ConvertConfig) -> dict[str, nn.Module | None]:
    """Every linear layer the conversion makes, with the module whose forward receives its
    input: the module itself, or for an nn.MultiheadAttention's projections the attention
    (None for its ``out_proj``, never called as a module: no statistics)."""
    parts: dict[str, nn.Module | None] = {}
    for name, module, converter in chosen:
        if converter.switch != "linear":
            continue
        if isinstance(module, nn.MultiheadAttention):
            packed = config.attention_in_proj == "packed"
            for part in ("in_proj",) if packed else IN_PARTS:
                parts[f"{name}.{part}"] = module
            parts[f"{name}.out_proj"] = None
        else:
            parts[name] = module
    return parts


def convert_(
    model: nn.Module, config: ConvertConfig | None = None,
    calibration: Iterable | None = None, *, progress: Callable[[int], None] | None = None,
    loss: LossFn | None = None, measure: Iterable | None = None, **overrides,
) -> ConversionReport:
    """Replace the modules of ``model`` that a converter of :data:`CONVERTERS` matches (Linear,
    Conv1D, MultiheadAttention; Embedding with ``embedding=True``) and the config selects by
    gated layers of the configured format, in place. Validate, match, replace, report.

    ``calibration``: an iterable of model inputs (tensors, dicts of keyword arguments as
    HuggingFace models take, tuples of arguments; e.g. a DataLoader): the linear layers are then
    decomposed to minimise the error of their outputs on these inputs (see the module
    docstring). ``progress``: called with the number of calibration batches done.

    With ``allocation="global", floor="measured"`` the model's loss decides between the global
    and the uniform ranks (:mod:`comera.surgery.measured_floor`): ``loss(output, batch)`` gives
    a batch's loss (default: the output's ``.loss``, as HuggingFace models return given
    labels); it is measured on ``measure`` (a separate, e.g. held-out, iterable of batches) or,
    when that is None, on the calibration batches themselves (held in a list for the second
    pass; in-sample, as ASVD's sensitivity is). ``allocation="sensitivity"`` reads ``loss`` and
    ``measure`` the same way, for its sweep and its floor. ``**overrides``: the fields of
    :class:`ConvertConfig` (an unknown name is a :class:`ConfigError` listing the known
    ones)."""
    check_module(model, "convert_(model, config=None, **options): load a saved model first (or "
                 "run `comera convert FILE -o OUT` on a file)")
    if config is None:
        check_options(overrides)
        config = ConvertConfig(**overrides)
    elif overrides:
        raise ConfigError("pass either a ConvertConfig or keyword options, not both.")
    calibration, measured = _measurement(config, calibration, loss, measure)
    converters = tuple(c for c in CONVERTERS if getattr(config, c.switch))
    candidates = _candidates(model, converters)
    chosen = [(n, m, c) for n, m, c in candidates if _matches(n, config)]
    if not chosen:
        searched = ", ".join(n for n, _, _ in candidates) or "none"
        kinds = "/".join(dict.fromkeys(c.source for c in converters))
        raise ConversionError(
            f"no {kinds} module matches include={list(config.include)} "
            f"exclude={list(config.exclude)}; modules of that type searched: {searched}."
        )
    tied = _tied(model, chosen)
    if len(tied) == len(chosen):
        raise ConversionError(f"every matching module has its weight tied to another module "
                              f"({', '.join(sorted(tied))}); converting would untie them. Select "
                              "other modules, or untie the weights first.")
    chosen = [(n, m, c) for n, m, c in chosen if n not in tied]
    _check_finite(chosen, tied)
    for name, module, converter in chosen:  # every refusal before the first swap
        converter.check(name, module, config)
    linear = _linear_parts(chosen, config)
    check_global(list(linear), config)
    check_sensitivity(list(linear), config)
    built, parts = [], []
    for name, module, converter in chosen:  # nothing is swapped until every layer is made
        layer, made = converter.convert(name, module, config)
        built.append((name, layer))
        parts += made
    if config.allocation in BUDGETED:  # a budget no allocation meets: before calibrating
        check_budget([p for p in parts if p.weight is not None], config)
    if config.allocation != "global" and config.target_compression:
        _refuse_out_of_reach(parts, config.target_compression)  # uniform's ranks are needed
    losses: dict[str, float] = {}
    if measured is not None:  # a loss the model cannot give: refused before calibrating
        losses["dense"] = model_loss(model, measured, loss)
        if not losses["dense"] < float("inf"):
            raise ConfigError(f"floor='measured': the dense model's loss on the measurement "
                              f"batches is {losses['dense']}; a loss must be finite to compare "
                              "allocations by.")
    taps = {name: module for name, module in linear.items() if module is not None}
    stats: dict[str, InputStats] = {}
    batches, held = 0, 0
    if calibration is not None:
        stats, batches = collect_input_stats(model, taps, calibration,
                                             config.attention_in_proj == "packed", progress,
                                             limit=config.statistics_memory)
        held = statistics_bytes(stats)
    if config.allocation == "sensitivity":
        floor, _ = sensitivity_floor_(model, built, parts, stats, config, measured, loss,
                                      losses["dense"])
        losses |= floor.losses
        kept = floor.kept
    elif measured is not None:
        floor = measured_floor_(model, built, parts, stats, config, measured, loss)
        losses |= floor.losses
        kept = floor.kept
    else:
        allocation = decompose_parts_(parts, stats, config)  # each linear layer once
        kept = allocation.kept if allocation is not None else ""
    errors = layer_errors(parts, stats)
    for name, layer in built:
        swap_submodule(model, name, layer)
    if not config.target_compression and config.allocation == "uniform":
        _warn_oversized(parts, config)
    fast_paths_off_(model)
    if callable(getattr(model, "save_pretrained", None)) and hasattr(model, "config"):
        warnings.warn(HF_SAVE_WARNING, UserWarning, stacklevel=2)
    return ConversionReport(tuple(_layer_report(p, errors, stats) for p in parts),
                            tuple(sorted(tied)), batches, config.allocation, kept, held,
                            tuple(losses.items()), len(measured) if measured is not None else 0)


def _measurement(config: ConvertConfig, calibration: Iterable | None, loss: LossFn | None,
                 measure: Iterable | None) -> tuple[Iterable | None, list | None]:
    """The calibration batches (in a list when they are also measured) and the measurement
    batches of ``floor="measured"`` (None without it); a :class:`ConfigError` for a refit or a
    measured floor without calibration, ``loss`` or ``measure`` given without a measured floor,
    a loss that is not callable, or no measurement batches."""
    if config.closed_form_refit and calibration is None:
        raise ConfigError("closed_form_refit=True fits each layer's output-side cores to its "
                          "calibration inputs: pass calibration=batches, or leave it False.")
    if config.floor != "measured":
        given = [n for n, v in (("loss", loss), ("measure", measure)) if v is not None]
        if given:
            raise ConfigError(f"{' and '.join(given)} given, but only floor='measured' reads "
                              "them; set ConvertConfig(allocation='global', floor='measured') "
                              "or allocation='sensitivity' "
                              "or leave them out.")
        return calibration, None
    if calibration is None:
        what = ("allocation='sensitivity' measures calibrated conversions"
                if config.allocation == "sensitivity" else
                "floor='measured' compares calibrated conversions")
        raise ConfigError(f"{what}: pass "
                          "calibration=batches (and loss=fn(output, batch) unless the model's "
                          "output has a .loss).")
    if loss is not None and not callable(loss):
        raise ConfigError(f"loss={loss!r}; pass a function loss(output, batch) -> scalar "
                          "tensor, or None to read the output's .loss.")
    if measure is None:
        calibration = list(check_batches(calibration))
        if not calibration:
            raise ConfigError("calibration gave no batches (an empty iterable); pass at least "
                              "one batch of inputs, e.g. calibration=[x].")
        return calibration, calibration
    measured = list(check_batches(measure))
    if not measured:
        raise ConfigError("measure gave no batches (an empty iterable); pass at least one "
                          "batch, or measure=None to measure on the calibration batches.")
    return calibration, measured
