"""``nn.MultiheadAttention`` with TT projections: what ``convert_`` puts in place of one.

torch's ``MultiheadAttention`` hands its packed dense ``in_proj_weight`` and ``out_proj.weight``
to ``F.multi_head_attention_forward`` (and its eval fast path to a fused kernel), so its
projections cannot simply be swapped for TT layers. ``TTMultiheadAttention`` keeps the same
call signature, attributes and results, and runs the projections through TT layers:

    q, k, v = q_proj(query), k_proj(key), v_proj(value)     # or in_proj: one TT layer, 3x out
    out = out_proj(softmax(q k^T / sqrt(head_dim) + mask) v)  # per head

For self-attention (``query is key is value``) the three projections read the input once: they
run as one stacked contraction (:class:`comera.layers.siblings.Siblings`), and ``in_proj`` as one
call. It has no dense ``in_proj_weight`` (None) and ``_qkv_same_embed_dim`` is False, so the fast
paths of ``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder`` take the regular path.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from comera.errors import ConfigError
from comera.layers.linear import GatedLayer
from comera.layers.siblings import Siblings
from comera.lean.sdpa import scaled_dot_product_attention


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A bool mask (True = not allowed) or a float mask as an additive float mask."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            mask, float("-inf"))
    return mask.to(dtype)


class TTMultiheadAttention(nn.Module):
    """Multi-head attention whose input and output projections are TT layers (see the module
    docstring); ``forward`` takes and returns what ``nn.MultiheadAttention.forward`` does."""

    in_proj_weight = None  # no packed dense weights: torch's fast paths see that and step aside
    in_proj_bias = None
    _qkv_same_embed_dim = False
    bias_k = bias_v = None
    add_zero_attn = False

    def __init__(self, embed_dim: int, num_heads: int, out_proj: GatedLayer,
                 in_proj: GatedLayer | None = None, q_proj: GatedLayer | None = None,
                 k_proj: GatedLayer | None = None, v_proj: GatedLayer | None = None,
                 dropout: float = 0.0, batch_first: bool = False,
                 kdim: int | None = None, vdim: int | None = None):
        super().__init__()
        if embed_dim % num_heads:
            raise ConfigError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}.")
        if (in_proj is None) == (q_proj is None or k_proj is None or v_proj is None):
            raise ConfigError("give either in_proj (one layer, 3 x embed_dim outputs) or all of "
                              "q_proj, k_proj and v_proj.")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.dropout, self.batch_first = float(dropout), bool(batch_first)
        if in_proj is not None:
            self.in_proj = in_proj
        else:
            self.q_proj, self.k_proj, self.v_proj = q_proj, k_proj, v_proj
        self.out_proj = out_proj
        self._siblings = Siblings()  # q/k/v of self-attention as one stacked contraction
        self.build_compiled()

    def build_compiled(self) -> None:
        """Build the stacked q/k/v network of the current shapes now (outside any
        ``torch.compile`` trace); forward rebuilds it itself after a truncation."""
        if not hasattr(self, "in_proj"):
            self._siblings.build_compiled((self.q_proj, self.k_proj, self.v_proj))

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_siblings", Siblings())  # pickled before siblings existed

    def _project(self, query: Tensor, key: Tensor, value: Tensor, same: bool):
        if hasattr(self, "in_proj"):
            if same:  # self-attention: one pass
                return self.in_proj(query).chunk(3, dim=-1)
            E = self.embed_dim
            q, k, v = (self.in_proj(t) for t in (query, key, value))
            return q[..., :E], k[..., E:2 * E], v[..., 2 * E:]
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if same:  # self-attention: x read once, one stacked contraction
            return self._siblings(projections, query)
        return tuple(p(t) for p, t in zip(projections, (query, key, value), strict=True))

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Tensor | None = None, need_weights: bool = True,
                attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        """As ``nn.MultiheadAttention.forward``: ``(attn_output, attn_weights or None)``."""
        same = key is query and value is query  # before the transposes below make new tensors
        batched = query.dim() == 3
        if not batched:  # (L, E) -> (1, L, E)
            query, key, value = (t.unsqueeze(0) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # (L, B, E) -> (B, L, E)
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        B, L, _ = query.shape
        S = key.shape[1]
        H, D = self.num_heads, self.head_dim
        q, k, v = self._project(query, key, value, same)
        q = q.reshape(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
        k = k.reshape(B, S, H, D).transpose(1, 2)  # (B, H, S, D)
        v = v.reshape(B, S, H, D).transpose(1, 2)  # (B, H, S, D)
        if attn_mask is None and is_causal:
            attn_mask = torch.ones(L, S, dtype=torch.bool, device=q.device).triu(1)
        mask = _additive(attn_mask, q.dtype)
        if mask is not None and mask.dim() == 3:  # (B*H, L, S) -> (B, H, L, S)
            mask = mask.reshape(B, H, L, S)
        padding = _additive(key_padding_mask, q.dtype)
        if padding is not None:  # (B, S) -> (B, 1, 1, S)
            padding = padding.reshape(B, 1, 1, S)
            mask = padding if mask is None else mask + padding
        dropout = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, H, L, S)
            if mask is not None:
                scores = scores + mask
            weights = scores.softmax(dim=-1)
            if dropout:  # as torch's: the returned weights are the dropped-out ones
                weights = F.dropout(weights, dropout)
            out = weights @ v  # (B, H, L, D)
            if average_attn_weights:
                weights = weights.mean(dim=1)  # (B, L, S)
            if not batched:
                weights = weights.squeeze(0)
        else:
            out = scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        out = self.out_proj(out.transpose(1, 2).reshape(B, L, self.embed_dim))  # (B, L, E)
        if not batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"dropout={self.dropout}, batch_first={self.batch_first}")
