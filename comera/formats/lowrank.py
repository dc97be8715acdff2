"""The plain low-rank format: ``W = A @ B`` with A (in, r) and B (r, out), the rank r gated.

The two-factor network is the smallest a bond can sit in, and it is the baseline every tensor
format is measured against (trained without the rank objective, at a fixed rank). It ignores
modes (``uses_modes`` is False). Initialisation by truncated SVD (Eckart-Young: the best rank-r
approximation, exact at full rank), exact rounding by QR of both factors and an SVD of the
small (r, r) product.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import tncomp.extend
from comera.errors import tncomp_errors_as_config
from comera.formats.bond_ranks import resolve_bond_ranks
from comera.formats.layout import Layout
from comera.formats.registry import Format, Ranks

__all__ = ["LowRank", "round_lowrank"]


class LowRank(Format):
    """Low-rank: x (i) times A (i, r) times B (r, o). ``ranks``: an int (or a one-element
    sequence), capped at ``min(in_features, out_features)``. Modes, if given, are multiplied
    out: the layer is a matrix product whatever the modes."""

    name, title, exact_decomposition, uses_modes = "lowrank", "low-rank", True, False

    def layout(self, in_modes, out_modes, ranks: Ranks) -> Layout:
        with tncomp_errors_as_config():
            n_in = math.prod(tncomp.extend.check_modes(in_modes, "in_modes"))
            n_out = math.prod(tncomp.extend.check_modes(out_modes, "out_modes"))
        (rank,) = resolve_bond_ranks(ranks, [min(n_in, n_out)], "ranks")
        return Layout(("i",), ("o",), (("i", "r"), ("r", "o")),
                      (("i", n_in), ("o", n_out), ("r", rank)), ("r",))

    def plain_decomposition(self, weight: Tensor, layout: Layout) -> list[Tensor]:
        """Truncated SVD (calibrated: of the whitened weight, SVD-LLM's optimum in the output
        error, :mod:`comera.formats.whitened`)."""
        with torch.no_grad():
            u, s, vh = torch.linalg.svd(weight.detach().to(torch.float64), full_matrices=False)
            rank = layout.size("r")
            root = s[:rank].sqrt()  # the singular values split evenly between A and B
            cores = [u[:, :rank] * root, root[:, None] * vh[:rank]]  # (i, r), (r, o)
        return [c.to(weight.dtype).contiguous() for c in cores]

    def round(self, cores: list[Tensor], layout: Layout) -> list[Tensor]:
        return round_lowrank(cores)

    def bond_spectra(self, weight: Tensor, layout: Layout) -> tuple[Tensor, ...]:
        """The weight's singular values (what truncating r discards)."""
        return (torch.linalg.svdvals(weight.detach().to(torch.float64)),)


def round_lowrank(cores: list[Tensor], rtol: float = 1e-7) -> list[Tensor]:
    """Exact rounding of float64 factors ``[A (i, r), B (r, o)]``: with ``A = Qa Ra`` and
    ``B^T = Qb Rb``, the SVD of ``Ra Rb^T`` (at most r x r) gives the product's singular values;
    those below ``rtol`` times the largest are dropped. ``A @ B`` is unchanged, r never grows,
    and the singular values end split evenly between the factors, as :meth:`LowRank.decompose`
    leaves them."""
    a, b = cores
    qa, ra = torch.linalg.qr(a)  # (i, p), (p, r)
    qb, rb = torch.linalg.qr(b.T)  # (o, q), (q, r)
    u, s, vh = torch.linalg.svd(ra @ rb.T, full_matrices=False)  # (p, k), (k,), (k, q)
    keep = max(1, int((s > rtol * s[0]).sum())) if s.numel() else 1
    root = s[:keep].sqrt()
    return [qa @ (u[:, :keep] * root), (root[:, None] * vh[:keep]) @ qb.T]  # (i, k), (k, o)
