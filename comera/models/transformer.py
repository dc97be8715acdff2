"""The six-encoder transformer of the paper's MNLI run, with every linear layer and the token
embedding as TT layers (or in any other registered format, ``linear_format``; or
``linear_format="dense"``, the baseline).

d_model 768, 12 heads, FFN 3072, GELU, post-LayerNorm, dropout 0.1, learned positions, max
length 128, and a pair-classification head on the first token. Shapes follow the paper:
Q/K/V/O 768x768 as [12,8,8]x[8,8,12]; FFN 768x3072 as [12,8,8]x[12,16,16] and back as
[16,16,12]x[8,8,12]; the embedding (vocabulary padded to prod(row_modes)) as m=[16,20,10,10],
n=[4,4,8,6] with rank 32.

``model.checkpoint_blocks = True`` (both models here; ``comera train --checkpoint-blocks``)
trades time for memory: in training, each encoder block keeps only its input for the backward
and runs its forward again there (non-reentrant :func:`torch.utils.checkpoint.checkpoint`).
The recomputation restores the RNG state, so dropout draws the same masks: losses, gradients
and the RNG stream are those of a run without it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import InitVar, dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from comera.errors import ConfigError
from comera.formats.registry import DENSE, format_names, get_format, layer_formats
from comera.formats.scaling import FRESH, check_parametrization
from comera.formats.tt_flag import (  # noqa: F401  (their home; imported from here before)
    NO_FLAG,
    TT_FLAG_RELEASE,
    format_from_tt,
    restore_kind_,
)
from comera.layers.cola import ColaLinear
from comera.layers.embedding import gated_embedding, table_format
from comera.layers.linear import DEFAULT_TAU, GatedLinear, TTLinear
from comera.layers.siblings import Siblings
from comera.lean.dropout import BoolMaskDropout
from comera.lean.sdpa import scaled_dot_product_attention
from comera.numbers import is_int

#: Layer kinds that are not weight formats (no dense weight: :mod:`comera.formats.registry`
#: does not list them): name -> the layer's class, built as ``cls(n_in, n_out, rank, bias=...,
#: tau=..., parametrization=...)``. A model with such layers keeps its token table dense.
LAYER_KINDS: dict[str, type[nn.Module]] = {"cola": ColaLinear}


def layer_kinds() -> tuple[str, ...]:
    """What a model's linear layers may be: ``"dense"``, a format built from modes
    (:func:`~comera.formats.registry.layer_formats`) or a kind of :data:`LAYER_KINDS`."""
    return (*layer_formats(), *LAYER_KINDS)


def check_layer_kind(value: str, what: str = "linear") -> str:
    """``value`` as a model's layer kind (:func:`layer_kinds`), else a :class:`ConfigError`
    naming it and the choices."""
    if isinstance(value, str) and value in LAYER_KINDS:
        return value
    if not isinstance(value, str) or value not in layer_formats():
        raise ConfigError(f"{what}={value!r}; choose one of {', '.join(layer_kinds())}.")
    return value


def check_token_ids(ids: Tensor, max_len: int) -> int:
    """The sequence length of token ids shaped (batch, seq_len) of at most ``max_len``, else a
    :class:`ConfigError` naming the shape and the fix (every model of this package reads ids so)."""
    if ids.dim() != 2:
        raise ConfigError(f"ids has shape {tuple(ids.shape)}; expected (batch, seq_len).")
    s = ids.shape[1]
    if s > max_len:
        raise ConfigError(f"sequence length {s} exceeds max_len={max_len}; "
                          "truncate the inputs or raise max_len.")
    return s


def check_sizes(config: Any, names: Iterable[str]) -> None:
    """The checks every transformer config here shares: each size ``names`` of ``config`` is an
    int >= 1 (:func:`comera.numbers.is_int`), ``n_heads`` divides ``d_model`` and ``dropout``
    lies in [0, 1); else a :class:`ConfigError` naming the first value that fails."""
    for name in names:
        value = getattr(config, name)
        if not is_int(value):
            raise ConfigError(f"{name}={value!r}; it must be an int >= 1.")
    if config.d_model % config.n_heads:
        raise ConfigError(f"d_model={config.d_model} is not divisible by n_heads="
                          f"{config.n_heads}; pick a head count that divides it.")
    if not (isinstance(config.dropout, int | float) and 0.0 <= config.dropout < 1.0):
        raise ConfigError(f"dropout={config.dropout!r}; it lies in [0, 1).")


@dataclass(frozen=True)
class TransformerConfig:
    """Sizes and the layers' kind. ``linear_format="dense"`` builds the dense baseline of the
    same model. ``tt`` (deprecated until 0.3.0, with a DeprecationWarning): ``tt=False`` reads as
    ``linear_format="dense"``, ``tt=True`` leaves ``linear_format`` as given."""

    vocab_size: int = 30522
    d_model: int = 768
    n_heads: int = 12
    d_ff: int = 3072
    n_layers: int = 6
    max_len: int = 128
    n_classes: int = 3
    dropout: float = 0.1
    tt_embedding: bool = True  # a compressed model's token table in the layers' format too
    rank: int = 30
    embedding_rank: int = 32
    attn_modes: tuple[tuple[int, ...], tuple[int, ...]] = ((12, 8, 8), (8, 8, 12))
    ffn_in_modes: tuple[tuple[int, ...], tuple[int, ...]] = ((12, 8, 8), (12, 16, 16))
    ffn_out_modes: tuple[tuple[int, ...], tuple[int, ...]] = ((16, 16, 12), (8, 8, 12))
    embedding_modes: tuple[tuple[int, ...], tuple[int, ...]] = ((16, 20, 10, 10), (4, 4, 8, 6))
    tau: float = 1e-2
    # the layers' kind: "dense" (the baseline), a format built from modes (layer_formats();
    # the token table takes the format's table, e.g. TT's a TT-matrix one) or a LAYER_KINDS
    # kind ("cola": its token table dense)
    linear_format: str = "tt"
    # how gated layers scale their cores (formats.scaling.FRESH: balanced, as every fresh layer)
    parametrization: str = FRESH
    tt: InitVar[Any] = NO_FLAG  # deprecated: see the class docstring

    def __post_init__(self, tt: Any) -> None:
        if tt is not NO_FLAG and tt is not None:
            object.__setattr__(self, "linear_format", format_from_tt(
                tt, self.linear_format, "TransformerConfig(linear_format={})", stacklevel=4))
        check_parametrization(self.parametrization)
        if self.linear_format in format_names() and not get_format(self.linear_format).from_modes:
            raise ConfigError(f"linear_format={self.linear_format!r} is a declared network; "
                              "choose a format built from modes, e.g. 'tt' or 'tucker' (or "
                              "'dense').")
        check_layer_kind(self.linear_format, "linear_format")
        check_sizes(self, ("vocab_size", "d_model", "n_heads", "d_ff", "n_layers", "max_len",
                           "n_classes", "rank", "embedding_rank"))

    @classmethod
    def small(cls, vocab_size: int, **overrides) -> TransformerConfig:
        """A CPU-sized model (d_model 256, FFN 1024, 4 heads, 2 layers) with matching modes."""
        base = dict(vocab_size=vocab_size, d_model=256, n_heads=4, d_ff=1024, n_layers=2,
                    rank=16, embedding_rank=16, attn_modes=((4, 8, 8), (8, 8, 4)),
                    ffn_in_modes=((4, 8, 8), (8, 8, 16)), ffn_out_modes=((16, 8, 8), (8, 8, 4)),
                    embedding_modes=None)
        base.update(overrides)
        return cls(**base)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A config pickled with the ``tt`` flag of before loads as the kind it built."""
        restore_kind_(self, state, "linear_format")


def linear_layer(format: str, n_in: int, n_out: int, rank: int, modes=None, *,
                 bias: bool = True, tau: float = DEFAULT_TAU, d: int = 3,
                 parametrization: str = "balanced") -> nn.Module:
    """One linear layer of the kind ``format``: ``nn.Linear`` for ``"dense"``, the class of a
    :data:`LAYER_KINDS` kind (``"cola"``: :class:`~comera.layers.cola.ColaLinear`) at ``rank``,
    ``TTLinear`` for ``"tt"`` (the class TT checkpoints hold), else a ``GatedLinear`` in that
    format at max rank ``rank``. ``modes``: (in_modes, out_modes) for a format that uses
    modes, used when they multiply to the sizes (else factorised, ``d`` a side).
    ``parametrization``: how a gated layer scales its cores (:mod:`comera.formats.scaling`)."""
    if check_layer_kind(format, "format") == DENSE:
        return nn.Linear(n_in, n_out, bias=bias)
    if format in LAYER_KINDS:
        return LAYER_KINDS[format](n_in, n_out, rank, bias=bias, tau=tau,
                                   parametrization=parametrization)
    if modes is not None and (math.prod(modes[0]) != n_in or math.prod(modes[1]) != n_out):
        modes = None  # sizes changed by an override: factorize automatically
    if modes is None or not get_format(format).uses_modes:
        modes = (None, None)
    if format == "tt":
        return TTLinear(n_in, n_out, *modes, rank, bias=bias, tau=tau, d=d,
                        parametrization=parametrization)
    return GatedLinear(n_in, n_out, format, rank, *modes, bias=bias, tau=tau, d=d,
                       parametrization=parametrization)


def token_table(cfg: TransformerConfig, pad_id: int) -> nn.Module:
    """The token table: in the table of the layers' format (TT: a TT-matrix
    :class:`~comera.layers.embedding.TTEmbedding`) when the layers are in a format and
    ``cfg.tt_embedding``, else ``nn.Embedding`` (dense layers, a :data:`LAYER_KINDS` kind)."""
    if cfg.linear_format == DENSE or cfg.linear_format in LAYER_KINDS or not cfg.tt_embedding:
        return nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=pad_id)
    rows, cols = cfg.embedding_modes or (None, None)
    modes = ({"row_modes": rows, "col_modes": cols}
             if get_format(table_format(cfg.linear_format)).uses_modes else {})
    return gated_embedding(cfg.vocab_size, cfg.d_model, cfg.linear_format,
                           ranks=cfg.embedding_rank, padding_idx=pad_id, tau=cfg.tau,
                           d=len(rows) if rows else 3, **modes)


def linear(cfg: TransformerConfig, n_in: int, n_out: int, modes) -> nn.Module:
    """A linear layer of the model: its kind (a format, or dense) and rank, from ``cfg``."""
    return linear_layer(cfg.linear_format, n_in, n_out, cfg.rank, modes,
                        tau=cfg.tau, parametrization=cfg.parametrization)


class SelfAttention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.q = linear(cfg, d, d, cfg.attn_modes)
        self.k = linear(cfg, d, d, cfg.attn_modes)
        self.v = linear(cfg, d, d, cfg.attn_modes)
        self.o = linear(cfg, d, d, cfg.attn_modes)
        self.dropout = cfg.dropout
        self._siblings = Siblings()  # q, k, v read x once: one stacked contraction
        self.build_compiled()

    def build_compiled(self) -> None:
        """Build the stacked q/k/v network of the current shapes now (outside any
        ``torch.compile`` trace); forward rebuilds it itself after a truncation."""
        self._siblings.build_compiled((self.q, self.k, self.v))

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_siblings", Siblings())  # pickled before siblings existed

    def forward(self, x: Tensor, pad_mask: Tensor) -> Tensor:
        b, s, d = x.shape
        h = self.n_heads

        def heads(t: Tensor) -> Tensor:
            return t.view(b, s, h, d // h).transpose(1, 2)  # (b, h, s, d/h)

        q, k, v = (heads(t) for t in self._siblings((self.q, self.k, self.v), x))
        mask = pad_mask[:, None, None, :]  # (b, 1, 1, s): True where a real token
        att = scaled_dot_product_attention(  # comera.lean.sdpa: a bool dropout mask on the CPU
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0)
        return self.o(att.transpose(1, 2).reshape(b, s, d))  # (b, s, d)


class EncoderBlock(nn.Module):
    """Post-LayerNorm encoder block: x = LN(x + attn(x)); x = LN(x + FFN(x))."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.attn = SelfAttention(cfg)
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.ffn_in = linear(cfg, cfg.d_model, cfg.d_ff, cfg.ffn_in_modes)
        self.ffn_out = linear(cfg, cfg.d_ff, cfg.d_model, cfg.ffn_out_modes)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.drop = BoolMaskDropout(cfg.dropout)

    def forward(self, x: Tensor, pad_mask: Tensor) -> Tensor:
        x = self.ln1(x + self.drop(self.attn(x, pad_mask)))
        h = self.ffn_in(x)  # (b, s, d_ff)
        # ffn_out(drop(gelu(h))), its input rebuilt in the backward from h and the mask
        ffn = self.drop.feed(nn.functional.gelu(h), self.ffn_out, lambda: nn.functional.gelu(h))
        return self.ln2(x + self.drop(ffn))


def run_blocks(blocks: nn.ModuleList, x: Tensor, pad_mask: Tensor, checkpoint: bool) -> Tensor:
    """``x`` (b, s, d) through each encoder block. With ``checkpoint`` (and autograd recording),
    a block saves only its inputs and recomputes its activations in the backward."""
    recompute = checkpoint and torch.is_grad_enabled()
    for block in blocks:
        if recompute:  # non-reentrant: RNG (dropout) and autocast state replayed as they were
            x = torch.utils.checkpoint.checkpoint(block, x, pad_mask, use_reentrant=False)
        else:
            x = block(x, pad_mask)  # (b, s, d)
    return x


class PairClassifier(nn.Module):
    """Token + position + segment embeddings, N encoder blocks, a head on the first token.

    ``checkpoint_blocks``: recompute each block's activations in the backward while training
    (less memory, about one more forward of time; same results)."""

    checkpoint_blocks: bool = False  # class default: models pickled before it existed

    def __init__(self, cfg: TransformerConfig, pad_id: int = 0):
        super().__init__()
        self.cfg = cfg
        self.tokens = token_table(cfg, pad_id)
        self.positions = nn.Embedding(cfg.max_len, cfg.d_model)
        self.segments = nn.Embedding(2, cfg.d_model)
        self.ln = nn.LayerNorm(cfg.d_model)
        self.drop = BoolMaskDropout(cfg.dropout)
        self.blocks = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.n_layers))
        self.head = nn.Linear(cfg.d_model, cfg.n_classes)
        self.pad_id = pad_id

    def forward(self, ids: Tensor, segments: Tensor | None = None) -> Tensor:
        s = check_token_ids(ids, self.cfg.max_len)
        pos = torch.arange(s, device=ids.device)
        seg = segments if segments is not None else torch.zeros_like(ids)
        x = self.tokens(ids) + self.positions(pos)[None] + self.segments(seg)  # (b, s, d)
        x = self.drop(self.ln(x))
        pad_mask = ids != self.pad_id  # (b, s)
        x = run_blocks(self.blocks, x, pad_mask, self.checkpoint_blocks and self.training)
        return self.head(x[:, 0])  # (b, n_classes)
