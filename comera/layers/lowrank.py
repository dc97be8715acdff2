"""Plain low-rank linear layer ``y = x @ A @ B + b`` (the CoLA / LoRA-style factors).

The baseline next to the tensor-train layers: the same parameter budget spent on two matrix
factors A (in_features x rank) and B (rank x out_features) instead of TT cores. It has no rank
gates, so the rank adaptation of comera leaves it alone; its rank is fixed at construction.

How it is counted: :func:`comera.ranks.size.model_size` counts its parameters as ordinary
(non-TT) parameters, which is its true size. :func:`~comera.ranks.size.dense_size` does not know
it stands for a dense matrix, so ``compression_ratio(model)`` does not credit it. Use the layer's
own :meth:`LowRankLinear.num_parameters` and :meth:`LowRankLinear.dense_num_parameters` (the same
names ``GatedLayer`` layers have), e.g. through :func:`lowrank_sizes`, for ratios against dense.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from comera.errors import ConfigError

__all__ = ["LowRankLinear", "lowrank_sizes", "rank_for_size"]


def _check_positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r}; expected an int >= 1.")
    return value


def rank_for_size(in_features: int, out_features: int, params: int, bias: bool = True) -> int:
    """The largest rank r whose layer has at most ``params`` parameters:
    ``r * (in_features + out_features) (+ out_features for the bias) <= params``, capped at
    ``min(in_features, out_features)`` (a higher rank only repeats the dense matrix).

    Raises :class:`ConfigError` when even rank 1 does not fit the budget."""
    _check_positive_int("in_features", in_features)
    _check_positive_int("out_features", out_features)
    _check_positive_int("params", params)
    free = params - (out_features if bias else 0)
    rank = min(free // (in_features + out_features), in_features, out_features)
    if rank < 1:
        need = in_features + out_features + (out_features if bias else 0)
        raise ConfigError(
            f"params={params} is below a rank-1 {in_features}x{out_features} low-rank layer "
            f"({need} parameters with bias={bias}); give a budget of at least {need}.")
    return int(rank)


class LowRankLinear(nn.Module):
    """``y = x @ A @ B + bias`` with A of shape (in_features, rank), B of shape
    (rank, out_features): a rank-``rank`` weight in two factors.

    The default initialisation draws A and B Gaussian with the same rule as the TT layers: the
    product A @ B has entries of variance about 1/(in_features + out_features); the bias is 0.
    """

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        self.in_features = _check_positive_int("in_features", in_features)
        self.out_features = _check_positive_int("out_features", out_features)
        self.rank = _check_positive_int("rank", rank)
        factory = {"dtype": dtype, "device": device}
        self.A = nn.Parameter(torch.empty(in_features, rank, **factory))
        self.B = nn.Parameter(torch.empty(rank, out_features, **factory))
        self.bias = nn.Parameter(torch.zeros(out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Gaussian factors with Var((A @ B)_ij) = 1/(in_features + out_features); bias 0."""
        target = 1.0 / (self.in_features + self.out_features)
        std = (target / self.rank) ** 0.25
        with torch.no_grad():
            self.A.normal_(0.0, std)
            self.B.normal_(0.0, std)
            if self.bias is not None:
                self.bias.zero_()

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int) -> LowRankLinear:
        """The best rank-``rank`` approximation of a trained ``nn.Linear`` (truncated SVD, the
        singular values split evenly as sqrt(S) into both factors); exact at full rank."""
        if not isinstance(linear, nn.Linear):
            raise ConfigError(f"from_linear takes an nn.Linear, got {type(linear).__name__}.")
        _check_positive_int("rank", rank)
        full = min(linear.in_features, linear.out_features)
        if rank > full:
            raise ConfigError(
                f"rank={rank} exceeds min(in_features, out_features)={full} of the "
                f"{linear.in_features}->{linear.out_features} layer; use rank <= {full}.")
        w = linear.weight.detach()
        layer = cls(linear.in_features, linear.out_features, rank, linear.bias is not None,
                    dtype=w.dtype, device=w.device)
        u, s, vh = torch.linalg.svd(w.T, full_matrices=False)  # W^T = U S V^T: (in, out)
        root = s[:rank].sqrt()
        with torch.no_grad():
            layer.A.copy_(u[:, :rank] * root)  # (in, r)
            layer.B.copy_(root[:, None] * vh[:rank])  # (r, out)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.detach())
        return layer

    def forward(self, x: Tensor) -> Tensor:
        """``x @ A @ B + bias`` for ``x`` of shape ``(..., in_features)``."""
        if x.shape[-1] != self.in_features:
            raise ConfigError(
                f"LowRankLinear expects inputs whose last axis has {self.in_features} features, "
                f"got shape {tuple(x.shape)}.")
        y = (x @ self.A) @ self.B  # (..., r) then (..., out)
        return y + self.bias if self.bias is not None else y

    def to_dense(self) -> Tensor:
        """The dense weight as nn.Linear stores it: (out_features, in_features)."""
        return (self.A @ self.B).T

    def num_parameters(self, effective: bool = True) -> int:
        """Parameters of the layer: both factors and the bias (``effective`` is accepted for the
        same call as ``GatedLayer``; a low-rank layer has no gates, so both counts agree)."""
        return sum(p.numel() for p in self.parameters())

    def dense_num_parameters(self) -> int:
        """Parameters of the equivalent dense layer: ``in_features * out_features`` + bias."""
        return self.in_features * self.out_features + (
            self.bias.numel() if self.bias is not None else 0)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.rank}, bias={self.bias is not None}")


def lowrank_sizes(model: nn.Module) -> tuple[int, int]:
    """(parameters, dense parameters) summed over the model's :class:`LowRankLinear` layers."""
    layers = [m for m in model.modules() if isinstance(m, LowRankLinear)]
    return (sum(m.num_parameters() for m in layers),
            sum(m.dense_num_parameters() for m in layers))

