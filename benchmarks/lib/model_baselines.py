"""Whole-model baselines for the transformer benchmark: GaLore on the dense model, and the same
transformer with tensorly-torch TT layers in place of its linear layers and token embedding.

- :func:`make_galore_optimizer`: ``galore_torch.GaLoreAdamW`` with the GaLore paper's recipe:
  the 2-D weights of the attention and FFN linears are projected (``rank``,
  ``update_proj_gap`` 200, ``scale`` 0.25, ``proj_type`` "std"); every other parameter
  (embeddings, LayerNorms, biases, the head) gets plain AdamW in the same optimizer.
- :func:`tltorch_transformer`: :class:`comera.models.transformer.PairClassifier` built dense,
  then every linear in the encoder blocks swapped for a tensorly-torch TT layer at CoMERA's
  ranks, and the token embedding for ``tltorch.FactorizedEmbedding`` (BlockTT, the TT-matrix
  format CoMERA's ``TTEmbedding`` uses) at the same modes and ranks.

``galore_torch`` (which imports transformers and bitsandbytes, about 8 s) and ``tltorch`` (which
sets tensorly's global backend when imported) are imported inside the functions that need them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor, nn

import tncomp
from comera.errors import ConfigError
from comera.layers.embedding import TTEmbedding
from comera.layers.linear import resolve_modes
from comera.models.transformer import PairClassifier, TransformerConfig

__all__ = [
    "GALORE_PAPER_RANK",
    "GaLoreConfig",
    "TltorchTTLinear",
    "default_galore_rank",
    "galore_param_groups",
    "galore_targets",
    "make_galore_optimizer",
    "tltorch_transformer",
]

# GaLore (Zhao et al., ICML 2024), Table 2: rank 128 for the 60M LLaMA (hidden 512), the model
# closest in parameter count to the paper's 67M six-encoder transformer; 256 for the 130M one
# (hidden 768), 256 at 350M (1024), 512 at 1B (2048).
GALORE_PAPER_RANK = 128

TTFormat = Literal["tt", "blocktt"]


def default_galore_rank(d_model: int) -> int:
    """128 (the GaLore paper's 60M setting), capped at ``d_model // 4`` for smaller models (the
    rank / hidden-size ratio of its 60M, 350M and 1B settings)."""
    return max(1, min(GALORE_PAPER_RANK, d_model // 4))


@dataclass(frozen=True)
class GaLoreConfig:
    """GaLoreAdamW settings; defaults are the GaLore paper's recipe (rank: see
    :func:`default_galore_rank`)."""

    rank: int = GALORE_PAPER_RANK
    update_proj_gap: int = 200
    scale: float = 0.25
    proj_type: str = "std"
    lr: float = 1e-4
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"GaLore rank={self.rank!r}; give an int >= 1 (the paper: 128).")
        if self.update_proj_gap < 1:
            raise ConfigError(f"update_proj_gap={self.update_proj_gap}; give an int >= 1 "
                              "(steps between projection refreshes; the paper: 200).")
        if self.proj_type not in ("std", "reverse_std", "left", "right", "full"):
            raise ConfigError(f"proj_type={self.proj_type!r}; choose std, reverse_std, left, "
                              "right or full (the paper: std).")


def galore_targets(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The weights GaLore projects: the 2-D weight of every ``nn.Linear`` inside the encoder
    blocks (attention Q/K/V/O and the two FFN layers); the head is left to plain AdamW."""
    targets = [(f"{name}.weight", module.weight) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and name.startswith("blocks.")
               and module.weight.dim() == 2]
    if not targets:
        raise ConfigError(
            f"found no nn.Linear under 'blocks.' in {type(model).__name__}; GaLore projects the "
            "attention and FFN weights of a dense PairClassifier (build it with "
            "linear_format='dense')."
        )
    return targets


def galore_param_groups(model: nn.Module, config: GaLoreConfig) -> list[dict]:
    """Two groups: the GaLore targets (with their projection settings) and everything else."""
    projected = [p for _, p in galore_targets(model)]
    taken = {id(p) for p in projected}
    regular = [p for p in model.parameters() if id(p) not in taken]
    return [
        {"params": regular},
        {"params": projected, "rank": config.rank, "update_proj_gap": config.update_proj_gap,
         "scale": config.scale, "proj_type": config.proj_type},
    ]


def make_galore_optimizer(model: nn.Module, config: GaLoreConfig | None = None):
    """``galore_torch.GaLoreAdamW`` over :func:`galore_param_groups`."""
    from galore_torch import GaLoreAdamW  # imports transformers + bitsandbytes: about 8 s

    config = config if config is not None else GaLoreConfig()
    return GaLoreAdamW(galore_param_groups(model, config), lr=config.lr,
                       weight_decay=config.weight_decay, no_deprecation_warning=True)


# --------------------------------------------------------------------------------------------
# tensorly-torch TT layers in the same transformer
# --------------------------------------------------------------------------------------------


def _gaussian_(factors, n_in: int, n_out: int, bonds, seed: int) -> None:
    """Gaussian factors scaled so the dense weight has variance about 1/(n_in + n_out), as
    comera's layers are initialised."""
    std = (1.0 / (n_in + n_out) / math.prod(bonds)) ** (1.0 / (2 * len(factors)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for f in factors:
            f.copy_(torch.randn(f.shape, generator=gen, dtype=torch.float64) * std)


class TltorchTTLinear(nn.Module):
    """``y = x @ W + b`` with W (N_in, N_out) a ``tltorch.TTTensor`` over
    ``in_modes + out_modes``: the CoMERA TT layout and bonds, stored and reconstructed by
    tensorly-torch (a plain TT has no factorized forward in tltorch: its ``factorized_linear``
    rebuilds the dense weight for it, and so does this layer)."""

    def __init__(self, in_modes, out_modes, bonds, bias: bool = True, seed: int = 0):
        import tltorch

        super().__init__()
        self.in_modes, self.out_modes = tuple(in_modes), tuple(out_modes)
        self.in_features, self.out_features = math.prod(self.in_modes), math.prod(self.out_modes)
        self.weight = tltorch.TTTensor.new(self.in_modes + self.out_modes, rank=tuple(bonds))
        _gaussian_(list(self.weight.factors), self.in_features, self.out_features, bonds, seed)
        self.bias = nn.Parameter(torch.zeros(self.out_features)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight.to_tensor().reshape(self.in_features, self.out_features)  # (N_in, N_out)
        y = x @ w  # (..., N_out)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_modes={self.in_modes}, out_modes={self.out_modes}, "
                f"ranks={tuple(self.weight.rank)}")


def _blocktt_linear(in_modes, out_modes, rank: int, bias: bool, seed: int) -> nn.Module:
    """``tltorch.FactorizedLinear`` in BlockTT (TT-matrix): d cores (r, o_k, i_k, r') and
    tensorly-torch's factorized einsum forward, bonds capped at ``rank``."""
    import tltorch

    pairs = [o * i for o, i in zip(out_modes, in_modes, strict=True)]
    bonds = tncomp.resolve_ranks(rank, pairs)
    layer = tltorch.FactorizedLinear(tuple(in_modes), tuple(out_modes), bias=bias,
                                     factorization="BlockTT", rank=bonds,
                                     implementation="factorized")
    _gaussian_(list(layer.weight.factors), math.prod(in_modes), math.prod(out_modes), bonds,
               seed)
    if bias:
        with torch.no_grad():
            layer.bias.zero_()
    return layer


def _modes_for(cfg: TransformerConfig, n_in: int, n_out: int, modes):
    """The modes comera.models.transformer.linear gives this layer (its fallback included)."""
    if modes is not None and (math.prod(modes[0]) != n_in or math.prod(modes[1]) != n_out):
        modes = None
    in_modes, out_modes = modes if modes is not None else (None, None)
    return resolve_modes(n_in, n_out, in_modes, out_modes, 3)


def tltorch_transformer(cfg: TransformerConfig, factorization: TTFormat = "tt",
                        rank: int | None = None, seed: int = 0) -> PairClassifier:
    """``PairClassifier`` with tensorly-torch TT layers in place of every encoder linear and the
    token embedding.

    ``factorization``: "tt" (:class:`TltorchTTLinear`, CoMERA's layout and bonds) or "blocktt"
    (``tltorch.FactorizedLinear``, TT-matrix). ``rank``: max rank of the linears (default
    ``cfg.rank``, CoMERA's initial ranks). The embedding is always ``FactorizedEmbedding``
    (BlockTT) over the padded rows, modes and ranks of CoMERA's ``TTEmbedding``; it has no
    padding row (ids equal to the pad id get a trainable row).
    """
    import tltorch

    if factorization not in ("tt", "blocktt"):
        raise ConfigError(f"factorization={factorization!r}; choose 'tt' or 'blocktt'.")
    rank = cfg.rank if rank is None else rank
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"rank={rank!r}; give the max TT rank as an int >= 1.")
    torch.manual_seed(seed)
    model = PairClassifier(replace(cfg, linear_format="dense"))
    d, f = cfg.d_model, cfg.d_ff
    shapes = {"q": (d, d, cfg.attn_modes), "k": (d, d, cfg.attn_modes),
              "v": (d, d, cfg.attn_modes), "o": (d, d, cfg.attn_modes),
              "ffn_in": (d, f, cfg.ffn_in_modes), "ffn_out": (f, d, cfg.ffn_out_modes)}
    for b, block in enumerate(model.blocks):
        for name, (n_in, n_out, modes) in shapes.items():
            parent = block.attn if name in ("q", "k", "v", "o") else block
            in_modes, out_modes = _modes_for(cfg, n_in, n_out, modes)
            layer_seed = seed + 16 * b + len(name)
            if factorization == "tt":
                bonds = tncomp.resolve_ranks(rank, tuple(in_modes) + tuple(out_modes))
                new = TltorchTTLinear(in_modes, out_modes, bonds, seed=layer_seed)
            else:
                new = _blocktt_linear(in_modes, out_modes, rank, True, layer_seed)
            setattr(parent, name, new)
    rows, cols = cfg.embedding_modes or (None, None)
    ref = TTEmbedding(cfg.vocab_size, cfg.d_model, rows, cols, cfg.embedding_rank,
                      d=len(rows) if rows else 3)  # only read for its modes and bonds
    emb = tltorch.FactorizedEmbedding(math.prod(ref.row_modes), cfg.d_model,
                                      auto_tensorize=False,
                                      tensorized_num_embeddings=ref.row_modes,
                                      tensorized_embedding_dim=ref.col_modes,
                                      factorization="blocktt", rank=ref.bonds)
    model.tokens = emb
    return model
