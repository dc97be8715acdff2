"""A GPT-style causal language model whose every block linear layer is dense or in any format.

Token + learned position embeddings, N pre-LayerNorm decoder blocks (causal self-attention with
separate q, k, v, o projections, then a GELU FFN), a final LayerNorm and logits through the
token table (tied, as GPT-2). The six linear layers of each block are of the kind
``cfg.linear``: ``"dense"`` (``nn.Linear``) or any registered format at max rank ``cfg.rank``
(modes factorised from the sizes with ``cfg.tt_order`` modes per side; ``"tt"``:
:class:`~comera.layers.linear.TTLinear`, the layers CoMERA adapts; ``"lowrank"``: ``x @ A @ B``
with the rank gated, trained at a fixed rank when the rank objective is off; ``"cola"``:
:class:`~comera.layers.cola.ColaLinear`, ``B silu(A x)`` with the bottleneck gated).

The token table stays dense: the compressed layers are exactly the block linear layers, so
"compression of the linear layers" is what the frontier's targets speak of.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from comera.formats.scaling import FRESH, check_parametrization
from comera.layers.linear import DEFAULT_TAU
from comera.models.transformer import check_layer_kind, check_sizes, check_token_ids, linear_layer

EMBEDDING_STD = 0.02  # GPT-2's initializer_range


@dataclass(frozen=True)
class CausalLMConfig:
    """Sizes of the model and the kind of its block linear layers."""

    vocab_size: int = 2048
    d_model: int = 128
    n_heads: int = 4
    d_ff: int = 512
    n_layers: int = 2
    max_len: int = 64
    dropout: float = 0.0
    linear: str = "dense"  # "dense", a registered format or "cola" (transformer.layer_kinds())
    rank: int = 32  # the format's max rank
    tt_order: int = 3  # modes per side of a TT layer
    tau: float = DEFAULT_TAU
    # how gated layers scale their cores (formats.scaling.FRESH: balanced, as every fresh layer)
    parametrization: str = FRESH

    def __post_init__(self) -> None:
        check_layer_kind(self.linear, "linear")
        check_parametrization(self.parametrization)
        check_sizes(self, ("vocab_size", "d_model", "n_heads", "d_ff", "n_layers", "max_len",
                           "rank", "tt_order"))


def block_linear(cfg: CausalLMConfig, n_in: int, n_out: int) -> nn.Module:
    """One block linear layer of the kind ``cfg.linear``, without a bias (as Llama): every
    parameter of a compressed layer is then a weight parameter."""
    return linear_layer(cfg.linear, n_in, n_out, cfg.rank, bias=False, tau=cfg.tau,
                        d=cfg.tt_order, parametrization=cfg.parametrization)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t."""

    def __init__(self, cfg: CausalLMConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.q = block_linear(cfg, d, d)
        self.k = block_linear(cfg, d, d)
        self.v = block_linear(cfg, d, d)
        self.o = block_linear(cfg, d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        h = self.n_heads

        def heads(t: Tensor) -> Tensor:
            return t.view(b, s, h, d // h).transpose(1, 2)  # (b, h, s, d/h)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        att = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.o(att.transpose(1, 2).reshape(b, s, d))  # (b, s, d)


class DecoderBlock(nn.Module):
    """Pre-LayerNorm block: x = x + attn(LN(x)); x = x + FFN(LN(x))."""

    def __init__(self, cfg: CausalLMConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.ffn_in = block_linear(cfg, cfg.d_model, cfg.d_ff)
        self.ffn_out = block_linear(cfg, cfg.d_ff, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))  # (b, s, d)
        h = nn.functional.gelu(self.ffn_in(self.ln2(x)))  # (b, s, d_ff)
        return x + self.drop(self.ffn_out(h))


class CausalLM(nn.Module):
    """GPT-style decoder; ``model(ids)`` gives next-token logits (b, s, V)."""

    def __init__(self, cfg: CausalLMConfig):
        super().__init__()
        self.cfg = cfg
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.positions = nn.Embedding(cfg.max_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        with torch.no_grad():
            nn.init.normal_(self.tokens.weight, 0.0, EMBEDDING_STD)
            nn.init.normal_(self.positions.weight, 0.0, EMBEDDING_STD)

    def forward(self, ids: Tensor) -> Tensor:
        """Logits (b, s, V) of token ids (b, s): row t predicts token t + 1."""
        s = check_token_ids(ids, self.cfg.max_len)
        pos = torch.arange(s, device=ids.device)
        x = self.drop(self.tokens(ids) + self.positions(pos)[None])  # (b, s, d)
        for block in self.blocks:
            x = block(x)  # (b, s, d)
        return self.ln(x) @ self.tokens.weight.T  # (b, s, V): tied to the token table

    def block_linears(self) -> list[tuple[str, nn.Module]]:
        """(name, layer) of every block linear layer: the layers a frontier compresses."""
        names = ("attn.q", "attn.k", "attn.v", "attn.o", "ffn_in", "ffn_out")
        return [(f"blocks.{i}.{n}", block.get_submodule(n))
                for i, block in enumerate(self.blocks) for n in names]


__all__ = ["CausalLM", "CausalLMConfig", "DecoderBlock", "block_linear"]
