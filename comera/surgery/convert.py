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
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from comera.errors import ConfigError, ConversionError
from comera.layers.attention import TTMultiheadAttention
from comera.layers.embedding import TTEmbedding
from comera.layers.linear import (
    DEFAULT_TAU,
    GatedTrain,
    TTLinear,
    TTMLinear,
    check_finite_weight,
    check_memory,
)
from comera.surgery.swap import swap_submodule
from comera.surgery.table import text_table

FORMATS = ("tt", "ttm")
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
    format: str = "tt"
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
        if self.format not in FORMATS:
            raise ConfigError(f"format={self.format!r}; choose one of {', '.join(FORMATS)}.")
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
    """One converted layer: name, type, dense shape, modes, ranks and parameters before/after."""

    name: str
    kind: str
    shape: tuple[int, int]
    modes: tuple[tuple[int, ...], tuple[int, ...]]
    ranks: tuple[int, ...]
    before: int
    after: int


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
        """Parameters of the converted layers after conversion (TT)."""
        return sum(r.after for r in self.layers)

    def __str__(self) -> str:
        head = ("layer", "type", "shape", "modes", "ranks", "params", "TT params", "ratio")
        rows = [head]
        for r in self.layers:
            modes = f"{list(r.modes[0])}x{list(r.modes[1])}"
            rows.append((r.name, r.kind, f"{r.shape[0]}x{r.shape[1]}", modes,
                         str(list(r.ranks)), f"{r.before:,}", f"{r.after:,}",
                         f"{r.before / max(r.after, 1):.1f}x"))
        rows.append(("total", "", "", "", "", f"{self.before:,}", f"{self.after:,}",
                     f"{self.before / max(self.after, 1):.1f}x"))
        lines = text_table(rows[0], rows[1:])
        if self.skipped:
            lines.append(f"left dense (weight tied to another module): {', '.join(self.skipped)}")
        return "\n".join(lines)


def _matches(name: str, config: ConvertConfig) -> bool:
    return (any(fnmatch.fnmatchcase(name, p) for p in config.include)
            and not any(fnmatch.fnmatchcase(name, p) for p in config.exclude))


def _rank_for_target(make, dense: int, target: float) -> int:
    """The largest max rank whose TT cores hold at most dense/target parameters (at least 1).

    The size grows with the max rank until every bond reaches its TT-SVD bound, so bisect.
    """
    def size(rank: int) -> int:
        layer = make(rank)
        return sum(c.numel() for c in layer.cores)

    lo, hi = 1, 1
    while size(hi) <= dense / target and hi < 1 << 16:
        if size(hi * 2) == size(hi):  # every bond is at its bound already
            return hi
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= dense / target else (lo, mid)
    return lo


def _conv1d_types() -> tuple[type, ...]:
    """HuggingFace's ``Conv1D`` (a linear layer storing its weight as (in, out)), when loaded."""
    if "transformers" not in sys.modules:  # a model holding one has imported it already
        return ()
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return ()
    return (Conv1D,)


def _dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight`` (out, in) and ``bias``: the input of ``from_linear``."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias is not None,
                       dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


def _convert_one(name: str, module: nn.Module, config: ConvertConfig):
    modes = config.modes.get(name, (None, None))
    if isinstance(module, _conv1d_types()):  # weight (in, out), y = x @ weight + bias
        module = _dense_linear(module.weight.detach().T, module.bias)
    if isinstance(module, nn.Linear):
        cls = TTLinear if config.format == "tt" else TTMLinear

        def make(rank):
            return cls(module.in_features, module.out_features, modes[0], modes[1], rank,
                       module.bias is not None, config.tau, config.d)

        dense = module.in_features * module.out_features
        rank = (_rank_for_target(make, dense, config.target_compression)
                if config.target_compression else config.rank_for(name))
        return cls.from_linear(module, rank, modes[0], modes[1], config.tau, config.d)

    def make_emb(rank):
        return TTEmbedding(module.num_embeddings, module.embedding_dim, modes[0], modes[1], rank,
                           module.padding_idx, config.tau, config.d)

    dense = module.num_embeddings * module.embedding_dim
    rank = (_rank_for_target(make_emb, dense, config.target_compression)
            if config.target_compression else config.rank_for(name))
    return TTEmbedding.from_embedding(module, rank, modes[0], modes[1], config.tau, config.d)


def _convert_attention(name: str, mha: nn.MultiheadAttention, config: ConvertConfig):
    """A :class:`TTMultiheadAttention` computing what ``mha`` does, and its projections as
    (qualified name, the dense projection, its TT layer)."""
    if mha.bias_k is not None or mha.add_zero_attn:
        raise ConversionError(f"{name}: nn.MultiheadAttention with add_bias_kv / add_zero_attn "
                              "is not supported; leave it dense with exclude=[...].")
    E = mha.embed_dim
    bias = mha.in_proj_bias
    pieces = {}
    if config.attention_in_proj == "packed":
        if not mha._qkv_same_embed_dim:
            raise ConversionError(f"{name}: attention_in_proj='packed' needs kdim == vdim == "
                                  f"embed_dim (got {mha.kdim}, {mha.vdim}, {E}); use 'split'.")
        pieces["in_proj"] = _dense_linear(mha.in_proj_weight.detach(), bias)
    else:
        if mha._qkv_same_embed_dim:
            weights = mha.in_proj_weight.detach().chunk(3)
        else:
            weights = (mha.q_proj_weight.detach(), mha.k_proj_weight.detach(),
                       mha.v_proj_weight.detach())
        biases = bias.detach().chunk(3) if bias is not None else (None,) * 3
        for part, w, b in zip(("q_proj", "k_proj", "v_proj"), weights, biases, strict=True):
            pieces[part] = _dense_linear(w, b)
    pieces["out_proj"] = mha.out_proj
    layers = {part: _convert_one(f"{name}.{part}", dense, config)
              for part, dense in pieces.items()}
    attention = TTMultiheadAttention(E, mha.num_heads, dropout=mha.dropout,
                                     batch_first=mha.batch_first, kdim=mha.kdim, vdim=mha.vdim,
                                     **layers)
    attention.train(mha.training)
    return attention, [(f"{name}.{part}", pieces[part], layers[part]) for part in pieces]


def _tt_parts(layer: nn.Module):
    """The gated TT layers inside a converted module (itself, or those of a wrapper)."""
    return ((n, m) for n, m in layer.named_modules() if isinstance(m, GatedTrain))


def _check_finite(chosen: list[tuple[str, nn.Module]], tied: set[str]) -> None:
    """Every module to convert has finite weights, checked before the first swap, so a bad one
    leaves the model as it was; the error names the module."""
    for name, module in chosen:
        if name in tied:
            continue
        for pname, param in module.named_parameters(recurse=False):
            try:
                check_finite_weight(module, param)
            except ConversionError as exc:
                raise ConversionError(f"{name}.{pname}: {exc}") from None


def _tied(model: nn.Module, chosen: list[tuple[str, nn.Module]]) -> set[str]:
    """Names of chosen modules whose weight another module of ``model`` also holds."""
    owners: dict[int, set[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(name)
    return {name for name, module in chosen
            if isinstance(getattr(module, "weight", None), nn.Parameter)
            and len(owners.get(id(module.weight), ())) > 1}


def _shape(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    return tuple(module.weight.shape)  # Conv1D: (in, out)


def _layer_report(name: str, dense: nn.Module, layer) -> LayerReport:
    before = sum(p.numel() for p in dense.parameters())
    return LayerReport(name, type(layer).__name__, _shape(dense),
                       (layer.in_modes, layer.out_modes), layer.ranks, before,
                       layer.num_parameters(effective=True))


def full_bonds(layer: GatedTrain) -> tuple[int, ...]:
    """The largest bonds ``layer``'s modes allow (an exact TT of any matrix): bond k is the
    smaller of the products of the cores' inner sizes left and right of it."""
    inner = [math.prod(c.shape[1:-1]) for c in layer.cores]
    return tuple(min(math.prod(inner[:k]), math.prod(inner[k:])) for k in range(len(inner) + 1))


def _warn_oversized(layers: list[tuple[str, int, GatedTrain]],
                    reports: Mapping[str, LayerReport]) -> None:
    """One warning naming the layers whose requested rank reaches their full TT rank (the
    bonds are clipped there) or whose TT form holds more parameters than the dense layer."""
    full = [f"{name} (rank {rank} >= full {max(full_bonds(layer)[1:-1], default=1)})"
            for name, rank, layer in layers if rank >= max(full_bonds(layer)[1:-1], default=1)]
    larger = [f"{r.name} ({r.before / max(r.after, 1):.2f}x)"
              for r in (reports[name] for name, _, _ in layers) if r.after > r.before]
    if not (full or larger):
        return
    parts = []
    if full:
        parts.append(f"the requested rank reaches the full TT rank of {len(full)} layer(s): "
                     f"{_names(full)} (bonds are clipped there: the TT form is exact and "
                     "compresses nothing)")
    if larger:
        parts.append(f"compression below 1x (more parameters than dense) for {len(larger)} "
                     f"layer(s): {_names(larger)}")
    warnings.warn("convert_: " + "; ".join(parts) + ". Lower ranks (or set target_compression) "
                  "so the TT layers are smaller than the dense ones.", UserWarning, stacklevel=3)


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


def convert_(
    model: nn.Module, config: ConvertConfig | None = None, **overrides
) -> ConversionReport:
    """Replace the matching Linear/Embedding (and Conv1D, MultiheadAttention) modules of
    ``model`` by TT layers, in place."""
    if config is None:
        config = ConvertConfig(**overrides)
    elif overrides:
        raise ConfigError("pass either a ConvertConfig or keyword options, not both.")
    types: tuple[type, ...] = ()
    if config.linear:
        types += (nn.Linear, nn.MultiheadAttention, *_conv1d_types())
    if config.embedding:
        types += (nn.Embedding,)
    attention = [n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]
    candidates = [(n, m) for n, m in model.named_modules() if isinstance(m, types) and n
                  and not any(n.startswith(a + ".") for a in attention)]  # out_proj goes with
    chosen = [(n, m) for n, m in candidates if _matches(n, config)]
    if not chosen:
        searched = ", ".join(n for n, _ in candidates) or "none"
        kinds = "/".join(t.__name__ for t in types)
        raise ConversionError(
            f"no {kinds} module matches include={list(config.include)} "
            f"exclude={list(config.exclude)}; modules of that type searched: {searched}."
        )
    tied = _tied(model, chosen)
    if len(tied) == len(chosen):
        raise ConversionError(f"every matching module has its weight tied to another module "
                              f"({', '.join(sorted(tied))}); converting would untie them. Select "
                              "other modules, or untie the weights first.")
    _check_finite(chosen, tied)
    reports, oversized = [], []
    for name, module in chosen:
        if name in tied:
            continue
        if isinstance(module, nn.MultiheadAttention):
            layer, parts = _convert_attention(name, module, config)
        else:
            layer = _convert_one(name, module, config)
            parts = [(name, module, layer)]
        if config.memory != "fast":
            for _, part in _tt_parts(layer):
                part.memory = config.memory
        swap_submodule(model, name, layer)
        reports += [_layer_report(*part) for part in parts]
        if not config.target_compression:
            oversized += [(part_name, config.rank_for(part_name), part)
                          for part_name, _, part in parts]
    _warn_oversized(oversized, {r.name: r for r in reports})
    _fast_paths_off_(model)
    if callable(getattr(model, "save_pretrained", None)) and hasattr(model, "config"):
        warnings.warn(HF_SAVE_WARNING, UserWarning, stacklevel=2)
    return ConversionReport(tuple(reports), tuple(sorted(tied)))


