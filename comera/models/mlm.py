"""A BERT-style masked-language model on the encoder blocks of the pair classifier.

Token + position embeddings, LayerNorm, dropout, N post-LayerNorm encoder blocks, then BERT's
prediction head: a d x d transform, GELU, LayerNorm, and the vocabulary projection d -> V. Every
linear layer (head included) is of the kind ``cfg.linear_format`` (TT:
:class:`~comera.layers.linear.TTLinear`; ``"dense"``: ``nn.Linear``) and, in a compressed model
with ``cfg.tt_embedding``, the token table in the format's table (TT: a TT-matrix
:class:`~comera.layers.embedding.TTEmbedding`).

The TT vocabulary projection has ``V`` padded to the nearest size with balanced modes
(:func:`~comera.formats.factorize.suggest_padded_size`, e.g. 15,317 -> 15,360); the extra logits are
cut off, so they take no part in the loss. Its max rank is ``cfg.embedding_rank``, as for the token
table: the two vocabulary-sized layers share a rank budget, and a small max rank here bounds the
rank of the whole logit matrix. The projection is not tied to the token table (a TT table
and a TT projection have different formats); BERT ties them.

``model(ids, select)`` projects only the positions in ``select`` (the masked ones, about 15%):
the vocabulary projection is the largest layer, so this saves most of the head's work.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from comera.errors import ConfigError
from comera.formats.factorize import suggest_padded_size
from comera.formats.registry import DENSE
from comera.layers.embedding import GatedEmbedding
from comera.lean.dropout import BoolMaskDropout
from comera.models.transformer import (
    EncoderBlock,
    TransformerConfig,
    check_token_ids,
    linear,
    linear_layer,
    run_blocks,
    token_table,
)

IGNORE_INDEX = -100
EMBEDDING_STD = 0.02  # BERT's initializer_range
_VOCAB_MODES = 3  # modes per side of the TT vocabulary projection


class MaskedLM(nn.Module):
    """Encoder + BERT MLM head; ``cfg.n_classes`` is unused. ``checkpoint_blocks``: as in
    :class:`~comera.models.PairClassifier`, recompute each block in the backward."""

    checkpoint_blocks: bool = False

    def __init__(self, cfg: TransformerConfig, pad_id: int = 0):
        super().__init__()
        if not 0 <= pad_id < cfg.vocab_size:
            raise ConfigError(f"pad_id={pad_id} is outside the vocabulary [0, {cfg.vocab_size}).")
        self.cfg = cfg
        self.pad_id = pad_id
        self.vocab_size = cfg.vocab_size
        d = cfg.d_model
        self.tokens = token_table(cfg, pad_id)
        self.positions = nn.Embedding(cfg.max_len, d)
        self.ln = nn.LayerNorm(d)
        self.drop = BoolMaskDropout(cfg.dropout)
        self.blocks = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.n_layers))
        # BERT's prediction head: transform (d x d, like the attention projections), GELU, LN
        self.transform = linear(cfg, d, d, cfg.attn_modes)
        self.head_ln = nn.LayerNorm(d)
        if cfg.linear_format != DENSE:
            padded = suggest_padded_size(cfg.vocab_size, _VOCAB_MODES)
            self.decoder = linear_layer(cfg.linear_format, d, padded, cfg.embedding_rank,
                                        tau=cfg.tau, d=_VOCAB_MODES,
                                        parametrization=cfg.parametrization)
        else:
            self.decoder = nn.Linear(d, cfg.vocab_size)
        self._init_embeddings_()

    @torch.no_grad()
    def _init_embeddings_(self) -> None:
        """BERT's embedding init, N(0, 0.02), for the token and position tables; a TT token
        table is rescaled to the same standard deviation. (Left at their defaults, a TT table
        has std ~1/sqrt(V + d) while positions have std 1: after the LayerNorm the tokens are
        drowned out and training stalls.)"""
        nn.init.normal_(self.positions.weight, 0.0, EMBEDDING_STD)
        if isinstance(self.tokens, GatedEmbedding):
            std = float(self.tokens.to_dense().std())
            self.tokens.cores[0].mul_(EMBEDDING_STD / std)
        else:
            nn.init.normal_(self.tokens.weight, 0.0, EMBEDDING_STD)
            self.tokens.weight[self.pad_id].zero_()

    def encode(self, ids: Tensor) -> Tensor:
        """Hidden states (b, s, d) of token ids (b, s); ``pad_id`` positions are not attended."""
        s = check_token_ids(ids, self.cfg.max_len)
        pos = torch.arange(s, device=ids.device)
        x = self.tokens(ids) + self.positions(pos)[None]  # (b, s, d)
        x = self.drop(self.ln(x))
        pad_mask = ids != self.pad_id  # (b, s): True where a real token
        return run_blocks(self.blocks, x, pad_mask, self.checkpoint_blocks and self.training)

    def head(self, hidden: Tensor) -> Tensor:
        """Vocabulary logits (..., V) of hidden states (..., d)."""
        h = self.head_ln(nn.functional.gelu(self.transform(hidden)))  # (..., d)
        return self.decoder(h)[..., : self.vocab_size]  # (..., V): padded logits cut off

    def forward(self, ids: Tensor, select: Tensor | None = None) -> Tensor:
        """Logits (b, s, V) of ids (b, s); with a boolean ``select`` (b, s), only the selected
        positions' logits (n, V), in row-major order (as ``labels[select]``)."""
        hidden = self.encode(ids)  # (b, s, d)
        if select is not None:
            if select.shape != ids.shape or select.dtype != torch.bool:
                raise ConfigError(f"select must be a bool tensor shaped like ids "
                                  f"{tuple(ids.shape)}, got {select.dtype} "
                                  f"{tuple(select.shape)}.")
            hidden = hidden[select]  # (n, d)
        return self.head(hidden)

    def loss(self, ids: Tensor, labels: Tensor) -> Tensor:
        """Mean cross-entropy over the positions whose label is not -100 (the masked ones)."""
        logits, targets = masked_logits(self, ids, labels)
        return nn.functional.cross_entropy(logits, targets)


def masked_logits(model: nn.Module, ids: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """(logits (n, V), targets (n,)) at the positions where ``labels`` is not -100.

    Calls ``model(ids, select)``, so it works through wrappers such as DistributedDataParallel.
    """
    if labels.shape != ids.shape:
        raise ConfigError(f"labels has shape {tuple(labels.shape)}, ids {tuple(ids.shape)}; "
                          "they must match (-100 where nothing is predicted).")
    select = labels != IGNORE_INDEX  # (b, s)
    if not bool(select.any()):
        raise ConfigError("labels hold no position to predict (all are -100); mask at least "
                          "one token per batch.")
    return model(ids, select), labels[select]
