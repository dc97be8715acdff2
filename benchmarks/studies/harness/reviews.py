"""The reviews task at the studies' size, and the training flags its studies share
(:mod:`benchmarks.studies.accuracy_frontier`, :mod:`benchmarks.studies.formats_accuracy`)."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from comera.experiments.task import model_format
from comera.experiments.transformer_task import ReviewsTask
from comera.formats.registry import DENSE
from comera.models import PairClassifier, TransformerConfig

__all__ = ["SmallReviews", "training_args"]


class SmallReviews(ReviewsTask):
    """The reviews task on a d_model-128 encoder (2 layers, FFN 512), CPU-minutes per model.
    The token table stays dense, so the gated layers (and the late stage's targets) are exactly
    the encoder's linear layers: the compression the targets speak of."""

    def model_config(self, format: str = "tt") -> TransformerConfig:
        base = super().model_config(format)
        # plain cores as the studies were measured (a method may name its parametrization)
        return replace(base, d_model=128, n_heads=4, d_ff=512, rank=16, tt_embedding=False,
                       attn_modes=None, ffn_in_modes=None, ffn_out_modes=None,
                       parametrization="plain")

    def build(self, format: str = DENSE, rank: int | None = None, **sizes: int) -> nn.Module:
        """The classifier with its encoder linear layers of the kind ``format`` at ``rank``
        (default 16), of other ``sizes`` (d_model, d_ff, ...) if given."""
        config = self.model_config(model_format(format))
        changes = {"rank": rank} if rank is not None else {}
        return PairClassifier(replace(config, **changes, **sizes))

    @staticmethod
    def block_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
        """(name, layer) of every encoder linear layer: the layers the targets speak of."""
        return [(f"blocks.{i}.{n}", block.get_submodule(n)) for i, block in
                enumerate(model.blocks) for n in ("attn.q", "attn.k", "attn.v", "attn.o",
                                                  "ffn_in", "ffn_out")]


def training_args(p) -> None:
    """The training settings every reviews model of a comparison shares (and so takes the same
    flags for): batch, sequence length, learning rates, warm-up, evaluations and threads."""
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-gates", type=float, default=1e-2)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=150)
    p.add_argument("--threads", type=int, default=1)
