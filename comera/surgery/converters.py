"""The converter list of ``convert_``: one entry per source module type, first match wins.

As PEFT's ``dispatch_*`` functions: each :class:`Converter` says which modules it matches, how it
reads their weight (in x out) and bias, and how it builds the gated layer(s) that replace them.
The target format comes from the config (:meth:`ConvertConfig.format_for`), so nothing here
names a format: a linear weight becomes a :class:`~comera.layers.linear.GatedLinear` of any
registered format, an embedding table a table of the format's
(:func:`~comera.layers.embedding.table_format`: TT and TT-matrix tables are
:class:`~comera.layers.embedding.TTEmbedding`, others a
:class:`~comera.layers.embedding.GatedEmbedding`).
Adding a source type is one entry in :data:`CONVERTERS`.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor, nn

from comera.errors import ConfigError, ConversionError
from comera.formats.bond_ranks import FullRankWarning, full_rank
from comera.formats.layout import Layout
from comera.formats.registry import Format, get_format
from comera.layers.attention import TTMultiheadAttention
from comera.layers.classes import linear_class
from comera.layers.embedding import embedding_class, table_format
from comera.layers.linear import GatedLayer, GatedLinear
from comera.ranks.budget import largest_rank, layout_size
from comera.surgery.config import ConvertConfig

IN_PARTS = ("q_proj", "k_proj", "v_proj")  # an nn.MultiheadAttention's split projections


class Part(NamedTuple):
    """One gated layer a conversion made: its qualified name, the dense (in, out) it stands
    for, the dense parameters it replaces, the layer, its format's name and its layout; for a
    linear map, the dense ``weight`` (in x out) and ``bias`` it was made from (a calibrated or
    globally allocated conversion decomposes them again)."""

    name: str
    shape: tuple[int, int]
    before: int
    layer: GatedLayer
    format: str
    layout: Layout
    weight: Tensor | None = None
    bias: Tensor | None = None


Convert = Callable[[str, nn.Module, ConvertConfig], tuple[nn.Module, list[Part]]]


@dataclass(frozen=True)
class Converter:
    """How ``convert_`` turns one type of module into gated layers.

    source: the module type in words (errors list it); switch: the ConvertConfig flag that turns
    the converter on (``"linear"`` or ``"embedding"``); types: the module types it matches
    (looked up when used, so an optional library is imported only if the model holds it);
    convert: ``(name, module, config) -> (replacement, parts)``; check: refusals raised before
    any module is swapped."""

    source: str
    switch: str
    types: Callable[[], tuple[type, ...]]
    convert: Convert
    check: Callable[[str, nn.Module, ConvertConfig], None] = (
        lambda name, module, config: _check_layer(name, config))

    def matches(self, module: nn.Module) -> bool:
        return isinstance(module, self.types())


def _check_layer(name: str, config: ConvertConfig) -> None:
    """The config gives the layer ``name`` a format and a rank, and modes only where its format
    uses modes (else a ConfigError, raised before any module is swapped)."""
    fmt = config.format_for(name)
    if not config.target_compression:
        config.rank_for(name)
    if name in config.modes and not get_format(fmt).uses_modes:
        raise ConfigError(f"modes={{{name!r}: ...}}: layer {name!r} is converted to the format "
                          f"{fmt!r}, which uses no modes; leave {name!r} out of modes.")


# -- building one gated linear layer from a dense weight ------------------------------------------
def _linear(fmt: str, in_features: int, out_features: int, modes, rank: int, bias: bool,
            config: ConvertConfig, **factory) -> GatedLinear:
    """A randomly initialised linear layer of ``fmt``, of the class registered for it
    (:func:`~comera.layers.classes.linear_class`), built by GatedLinear's constructor whatever
    that class's own signature (as records rebuild it by ``from_layout``)."""
    layer = linear_class(fmt).__new__(linear_class(fmt))
    with warnings.catch_warnings():  # convert_ names every such layer in one warning
        warnings.simplefilter("ignore", FullRankWarning)
        GatedLinear.__init__(layer, in_features, out_features, format=fmt, ranks=rank,
                             in_modes=modes[0], out_modes=modes[1], bias=bias, tau=config.tau,
                             d=config.d, memory=config.memory,
                             parametrization=config.parametrization, **factory)
    return layer


def rank_for_target(fmt: Format, probe: Layout, budget: float) -> int:
    """The largest uniform max rank whose cores (``fmt``'s layout on ``probe``'s modes) hold at
    most ``budget`` parameters (:func:`comera.ranks.budget.largest_rank`; at least 1)."""
    return max(1, largest_rank(
        lambda r: layout_size(fmt, probe.in_modes, probe.out_modes, r), budget))


def gated_linear(name: str, weight: Tensor, bias: Tensor | None, config: ConvertConfig,
                 decompose: bool = True) -> GatedLayer:
    """``weight`` (in x out) and ``bias`` as a gated layer of the format, modes and rank the
    config gives the layer ``name``, initialised by the format's decomposition (``decompose``
    False: left randomly initialised, for a pass that decomposes it once, at its final bonds:
    :func:`comera.surgery.decompose.decompose_parts_`)."""
    fmt = config.format_for(name)
    modes = config.modes.get(name, (None, None))
    if config.target_compression:
        probe = _linear(fmt, *weight.shape, modes, 1, False, config, device="meta")
        kept = bias.numel() if bias is not None else 0  # counted on both sides, as model_size does
        rank = rank_for_target(get_format(fmt), probe.layout,
                               (weight.numel() + kept) / config.target_compression - kept)
    else:
        rank = config.rank_for(name)
    layer = _linear(fmt, *weight.shape, modes, rank, bias is not None, config,
                    dtype=weight.dtype, device=weight.device)
    if decompose:
        layer.load_weight_(weight, bias)
    return layer


# -- the converters -------------------------------------------------------------------------------
def _linear_weight(module: nn.Linear) -> tuple[Tensor, Tensor | None]:
    return module.weight.detach().T, module.bias


def _conv1d_weight(module: nn.Module) -> tuple[Tensor, Tensor | None]:
    return module.weight.detach(), module.bias  # HF's Conv1D stores (in, out): y = x @ W + b


def _linear_like(read: Callable[[nn.Module], tuple[Tensor, Tensor | None]]) -> Convert:
    """The converter body of a module holding one linear map: read it, build one layer."""
    def convert(name: str, module: nn.Module, config: ConvertConfig):
        weight, bias = read(module)
        layer = gated_linear(name, weight, bias, config, decompose=False)
        before = sum(p.numel() for p in module.parameters())
        fmt = config.format_for(name)
        return layer, [Part(name, tuple(weight.shape), before, layer, fmt,
                            layer.layout, weight, bias)]
    return convert


def _check_embedding(name: str, module: nn.Embedding, config: ConvertConfig) -> None:
    _check_layer(name, config)
    try:
        table_format(config.format_for(name))
    except ConfigError as exc:
        raise ConfigError(f"the embedding {name!r}: {exc} Give the embeddings a pattern of "
                          f"their own, e.g. format={{{name!r}: 'ttm', '*': "
                          f"{config.format_for(name)!r}}}, or leave them dense with "
                          "embedding=False.") from None


def _embedding(name: str, module: nn.Embedding, config: ConvertConfig):
    """A table of the format the config gives ``name`` (held as :func:`table_format` says:
    a TT or TT-matrix table is a :class:`TTEmbedding`), initialised by its decomposition."""
    held = table_format(config.format_for(name))
    cls = embedding_class(held)
    modes = config.modes.get(name, (None, None))
    if config.target_compression:
        probe = cls(module.num_embeddings, module.embedding_dim, modes[0], modes[1], 1,
                    module.padding_idx, config.tau, config.d, format=held, device="meta")
        rank = rank_for_target(probe.format, probe.layout,
                               module.weight.numel() / config.target_compression)
    else:
        rank = config.rank_for(name)
    layer = cls.from_embedding(module, rank, modes[0], modes[1], config.tau, config.d,
                               format=held)
    if config.memory != "fast":
        layer.memory = config.memory
    shape = (module.num_embeddings, module.embedding_dim)
    return layer, [Part(name, shape, module.weight.numel(), layer, layer.format.name,
                        layer.layout)]


def _check_attention(name: str, mha: nn.MultiheadAttention, config: ConvertConfig) -> None:
    if mha.bias_k is not None or mha.add_zero_attn:
        raise ConversionError(f"{name}: nn.MultiheadAttention with add_bias_kv / add_zero_attn "
                              "is not supported; leave it dense with exclude=[...].")
    if config.attention_in_proj == "packed" and not mha._qkv_same_embed_dim:
        raise ConversionError(f"{name}: attention_in_proj='packed' needs kdim == vdim == "
                              f"embed_dim (got {mha.kdim}, {mha.vdim}, {mha.embed_dim}); use "
                              "'split'.")
    parts = ("in_proj",) if config.attention_in_proj == "packed" else IN_PARTS
    for part in (*parts, "out_proj"):
        _check_layer(f"{name}.{part}", config)


def _attention(name: str, mha: nn.MultiheadAttention, config: ConvertConfig):
    """A :class:`TTMultiheadAttention` computing what ``mha`` does: its q/k/v projections (or
    the packed ``in_proj``) and ``out_proj`` as gated layers, each named ``<name>.<part>``."""
    bias = mha.in_proj_bias
    pieces: dict[str, tuple[Tensor, Tensor | None]] = {}
    if config.attention_in_proj == "packed":
        pieces["in_proj"] = (mha.in_proj_weight.detach().T, bias)
    else:
        if mha._qkv_same_embed_dim:
            weights = mha.in_proj_weight.detach().chunk(3)
        else:
            weights = (mha.q_proj_weight.detach(), mha.k_proj_weight.detach(),
                       mha.v_proj_weight.detach())
        biases = bias.detach().chunk(3) if bias is not None else (None,) * 3
        for part, w, b in zip(IN_PARTS, weights, biases, strict=True):
            pieces[part] = (w.T, b)
    pieces["out_proj"] = _linear_weight(mha.out_proj)
    layers = {part: gated_linear(f"{name}.{part}", w, b, config, decompose=False)
              for part, (w, b) in pieces.items()}
    attention = TTMultiheadAttention(mha.embed_dim, mha.num_heads, dropout=mha.dropout,
                                     batch_first=mha.batch_first, kdim=mha.kdim, vdim=mha.vdim,
                                     **layers)
    attention.train(mha.training)
    parts = []
    for part, (w, b) in pieces.items():
        fmt = config.format_for(f"{name}.{part}")
        parts.append(Part(f"{name}.{part}", tuple(w.shape),
                          w.numel() + (b.numel() if b is not None else 0), layers[part], fmt,
                          layers[part].layout, w, b))
    return attention, parts


def conv1d_types() -> tuple[type, ...]:
    """HuggingFace's ``Conv1D`` (a linear layer storing its weight as (in, out)), when loaded."""
    if "transformers" not in sys.modules:  # a model holding one has imported it already
        return ()
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return ()
    return (Conv1D,)


#: the converter list, first match wins
CONVERTERS: tuple[Converter, ...] = (
    Converter("MultiheadAttention", "linear", lambda: (nn.MultiheadAttention,), _attention,
              _check_attention),
    Converter("Linear", "linear", lambda: (nn.Linear,), _linear_like(_linear_weight)),
    Converter("Conv1D", "linear", conv1d_types, _linear_like(_conv1d_weight)),
    Converter("Embedding", "embedding", lambda: (nn.Embedding,), _embedding, _check_embedding),
)


def converter_for(module: nn.Module, converters: tuple[Converter, ...]) -> Converter | None:
    """The first of ``converters`` that matches ``module`` (None when none does)."""
    return next((c for c in converters if c.matches(module)), None)


__all__ = ["CONVERTERS", "Converter", "Part", "converter_for", "full_rank",
           "gated_linear", "rank_for_target"]
