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
"""

from __future__ import annotations

import fnmatch
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn

from comera.errors import ConfigError, ConversionError
from comera.formats.registry import format_names, get_format
from comera.layers.attention import TTMultiheadAttention
from comera.layers.linear import DEFAULT_TAU, GatedTrain, check_finite_weight, check_memory
from comera.surgery.converters import CONVERTERS, Converter, Part, converter_for, full_rank
from comera.surgery.swap import swap_submodule
from comera.surgery.table import text_table

IN_PROJ = ("split", "packed")
HF_SAVE_WARNING = (
    "converted a HuggingFace model: its own save_pretrained does not keep the TT layers, and "
    "from_pretrained of that folder returns dense layers with fresh random weights. Save with "
    "comera.save_pretrained(model, folder) and load with comera.from_pretrained(folder, cls).")


@dataclass(frozen=True)
class ConvertConfig:
    """What to convert and how.

    include / exclude: fnmatch patterns over qualified module names ("*" matches all).
    ranks: a max rank for every layer, or {pattern: max rank}, first match wins.
    target_compression: instead of ranks, the largest uniform max rank per layer whose TT size
    is at most dense / target (per layer).
    """

    include: Sequence[str] = ("*",)
    exclude: Sequence[str] = ()
    linear: bool = True
    embedding: bool = False
    ranks: int | Mapping[str, int] = 16
    target_compression: float | None = None
    d: int = 3
    tau: float = DEFAULT_TAU
    # the target format of every linear layer (a name of comera.formats.format_names()), or
    # {pattern: format}, first match wins; embedding tables are TT-matrix ("tt" or "ttm")
    format: str | Mapping[str, str] = "tt"
    modes: Mapping[str, tuple[Sequence[int], Sequence[int]]] = field(default_factory=dict)
    # nn.MultiheadAttention's packed q/k/v projection: three TT layers ("split": <name>.q_proj,
    # .k_proj, .v_proj) or one with 3 x embed_dim outputs ("packed": <name>.in_proj)
    attention_in_proj: str = "split"
    # what the TT layers keep for the backward (tncomp's memory option, GatedTrain.memory):
    # "fast", "balanced", "min" or a byte budget per layer call
    memory: str | int = "fast"

    def __post_init__(self) -> None:
        for key in ("include", "exclude"):
            value = getattr(self, key)
            if isinstance(value, str):  # one pattern
                object.__setattr__(self, key, (value,))
            elif not isinstance(value, Sequence | set | frozenset) or any(
                    not isinstance(p, str) for p in value):
                raise ConfigError(f"{key}={value!r}; pass a list of fnmatch patterns over "
                                  f"module names, e.g. {key}=['encoder.*'].")
            else:
                object.__setattr__(self, key, tuple(value))
        for key in ("linear", "embedding"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key}={getattr(self, key)!r}; pass True or False.")
        if isinstance(self.ranks, Mapping):
            bad = {k: v for k, v in self.ranks.items() if not isinstance(k, str)
                   or not _is_rank(v)}
            if bad or not self.ranks:
                raise ConfigError(f"ranks={dict(self.ranks)!r}; a mapping of fnmatch pattern to "
                                  "a max rank (an int >= 1), e.g. ranks={'*': 16}.")
        elif not _is_rank(self.ranks):
            raise ConfigError(f"ranks={self.ranks!r}; a max rank is an int >= 1 (e.g. ranks=16), "
                              "or a mapping of pattern to rank.")
        if self.target_compression is not None and not (
                _is_number(self.target_compression) and self.target_compression > 1):
            raise ConfigError(f"target_compression={self.target_compression!r}; it must be a "
                              "finite number > 1 (dense size / TT size), or None to use ranks.")
        if isinstance(self.d, bool) or not isinstance(self.d, int) or self.d < 1:
            raise ConfigError(f"d={self.d!r}; the number of modes per side is an int >= 1 "
                              "(a TT layer has at least one mode per side; default 3).")
        if not (_is_number(self.tau) and self.tau >= 0):
            raise ConfigError(f"tau={self.tau!r}; the gate threshold is a finite number >= 0 "
                              f"(default {DEFAULT_TAU}).")
        _check_format(self.format)
        if not isinstance(self.modes, Mapping) or any(
                not isinstance(k, str) or not _is_modes(v) for k, v in self.modes.items()):
            raise ConfigError(f"modes={self.modes!r}; a mapping of layer name to (in_modes, "
                              "out_modes), each a list of ints >= 1, e.g. "
                              "modes={'fc': ([8, 8], [4, 16])}.")
        if self.attention_in_proj not in IN_PROJ:
            raise ConfigError(f"attention_in_proj={self.attention_in_proj!r}; choose one of "
                              f"{', '.join(IN_PROJ)}.")
        check_memory(self.memory)
        if not (self.linear or self.embedding):
            raise ConfigError("linear and embedding are both False: nothing would be converted.")

    def rank_for(self, name: str) -> int:
        """The max rank for the layer named ``name``: ``ranks`` itself, or the value of the first
        pattern in ``ranks`` that matches (a :class:`ConfigError` when none does)."""
        if isinstance(self.ranks, int):
            return self.ranks
        for pattern, rank in self.ranks.items():
            if fnmatch.fnmatchcase(name, pattern):
                return rank
        raise ConfigError(f"no ranks pattern matches layer {name!r}; add one or use '*'.")


    def format_for(self, name: str) -> str:
        """The format of the layer named ``name``: ``format`` itself, or the value of the first
        pattern in ``format`` that matches (a :class:`ConfigError` when none does)."""
        if isinstance(self.format, str):
            return self.format
        for pattern, fmt in self.format.items():
            if fnmatch.fnmatchcase(name, pattern):
                return fmt
        raise ConfigError(f"no format pattern matches layer {name!r} (patterns "
                          f"{list(self.format)}); add one or use '*'.")


def _check_format(value: object) -> None:
    """A registered format's name, or a non-empty {pattern: name} mapping of them."""
    names = format_names()
    if isinstance(value, str) and value in names:
        return
    if isinstance(value, Mapping) and value and all(
            isinstance(k, str) and isinstance(v, str) and v in names for k, v in value.items()):
        return
    raise ConfigError(f"format={value!r}; choose one of {', '.join(names)}, or map fnmatch "
                      "patterns to them, e.g. format={'encoder.*': 'tt', '*': 'ttm'}.")


def _is_number(value: object) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def _is_rank(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_modes(value: object) -> bool:
    return (isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2
            and all(isinstance(side, Sequence) and not isinstance(side, str) and side
                    and all(_is_rank(m) for m in side) for side in value))


@dataclass(frozen=True)
class LayerReport:
    """One converted layer: name, type, format, dense shape, modes, ranks and parameters
    before/after."""

    name: str
    kind: str
    shape: tuple[int, int]
    modes: tuple[tuple[int, ...], tuple[int, ...]]
    ranks: tuple[int, ...]
    before: int
    after: int
    format: str = "tt"


@dataclass(frozen=True)
class ConversionReport:
    """Per converted layer: shapes, modes, ranks and parameters before/after; ``skipped``: the
    matching layers left dense because their weight is tied to another module."""

    layers: tuple[LayerReport, ...]
    skipped: tuple[str, ...] = ()

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
                "ratio")
        rows = [(r.name, r.kind, r.format, f"{r.shape[0]}x{r.shape[1]}",
                 f"{list(r.modes[0])}x{list(r.modes[1])}", str(list(r.ranks)), f"{r.before:,}",
                 f"{r.after:,}", f"{r.before / max(r.after, 1):.1f}x") for r in self.layers]
        rows.append(("total", "", "", "", "", "", f"{self.before:,}", f"{self.after:,}",
                     f"{self.before / max(self.after, 1):.1f}x"))
        lines = text_table(head, rows)
        if self.skipped:
            lines.append(f"left dense (weight tied to another module): {', '.join(self.skipped)}")
        return "\n".join(lines)


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


def _layer_report(part: Part) -> LayerReport:
    layer = part.layer
    return LayerReport(part.name, type(layer).__name__, part.shape,
                       (part.layout.in_modes, part.layout.out_modes), layer.ranks, part.before,
                       layer.num_parameters(effective=True), part.format)


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


def _names(items: list[str], most: int = 6) -> str:
    more = f" and {len(items) - most} more" if len(items) > most else ""
    return ", ".join(items[:most]) + more


def _fast_paths_off_(model: nn.Module) -> None:
    """Switch off torch's transformer fast paths where they would read a converted weight."""
    def converted(module: nn.Module) -> bool:
        return any(isinstance(m, GatedTrain | TTMultiheadAttention) for m in module.modules())

    for module in model.modules():
        if isinstance(module, nn.TransformerEncoderLayer) and converted(module):
            module.activation_relu_or_gelu = 0  # the fast path requires relu/gelu flagged
        elif isinstance(module, nn.TransformerEncoder) and converted(module):
            module.use_nested_tensor = False


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


def convert_(
    model: nn.Module, config: ConvertConfig | None = None, **overrides
) -> ConversionReport:
    """Replace the modules of ``model`` that a converter of :data:`CONVERTERS` matches (Linear,
    Conv1D, MultiheadAttention; Embedding with ``embedding=True``) and the config selects by
    gated layers of the configured format, in place. Validate, match, replace, report."""
    if config is None:
        config = ConvertConfig(**overrides)
    elif overrides:
        raise ConfigError("pass either a ConvertConfig or keyword options, not both.")
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
    parts: list[Part] = []
    for name, module, converter in chosen:
        layer, made = converter.convert(name, module, config)
        swap_submodule(model, name, layer)
        parts += made
    if not config.target_compression:
        _warn_oversized(parts, config)
    _fast_paths_off_(model)
    if callable(getattr(model, "save_pretrained", None)) and hasattr(model, "config"):
        warnings.warn(HF_SAVE_WARNING, UserWarning, stacklevel=2)
    return ConversionReport(tuple(_layer_report(p) for p in parts), tuple(sorted(tied)))
