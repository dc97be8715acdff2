"""The CP (canonical polyadic) format: one factor per mode, all sharing one rank.

W (in x out) reshaped to ``(*in_modes, *out_modes)`` is a sum of r rank-one terms,
``W[n_1..n_N] = sum_r U_1[n_1, r] ... U_N[n_N, r]``: factor k is ``(n_k, r)`` and there is no
core. The one bond r is a hyperedge (carried by every factor), so one gate prunes a whole
rank-one term. It is the leanest format per rank (``r * sum(modes)`` parameters) but has no
closed-form decomposition: :meth:`CP.decompose` runs a few alternating least-squares sweeps from
an HOSVD start, which is approximate (``exact_decomposition`` is False), and there is no exact
rounding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import tncomp
from comera.errors import tncomp_errors_as_config
from comera.formats.bond_ranks import resolve_bond_ranks
from comera.formats.layout import Layout
from comera.formats.registry import Format, Ranks

__all__ = ["CP", "cp_als", "cp_to_tensor"]


class CP(Format):
    """CP: factors ``(n_k, r)`` for every input and output mode, one shared rank r.
    ``ranks``: an int (or a one-element sequence), capped at the largest rank a tensor of these
    modes can have, ``prod(modes) // max(modes)``."""

    name, title, exact_decomposition = "cp", "CP", False
    #: ALS sweeps :meth:`decompose` runs after its HOSVD start.
    sweeps: int = 10

    def layout(self, in_modes, out_modes, ranks: Ranks) -> Layout:
        with tncomp_errors_as_config():
            in_modes = tncomp.check_modes(in_modes, "in_modes")
            out_modes = tncomp.check_modes(out_modes, "out_modes")
        modes = in_modes + out_modes
        (rank,) = resolve_bond_ranks(ranks, [math.prod(modes) // max(modes)], "ranks")
        ins = tuple(f"i{k + 1}" for k in range(len(in_modes)))
        outs = tuple(f"o{k + 1}" for k in range(len(out_modes)))
        cores = tuple((n, "r") for n in ins + outs)
        sizes = (*zip(ins + outs, modes, strict=True), ("r", rank))
        return Layout(ins, outs, cores, sizes, ("r",))

    def decompose(self, weight: Tensor, layout: Layout) -> list[Tensor]:
        tensor = weight.detach().to(torch.float64).reshape(*layout.in_modes, *layout.out_modes)
        factors = cp_als(tensor, layout.size("r"), self.sweeps)
        return [f.to(weight.dtype).contiguous() for f in factors]


def cp_to_tensor(factors: list[Tensor]) -> Tensor:
    """The full tensor ``(n_1, ..., n_N)`` of CP factors ``(n_k, r)``."""
    full = factors[0]  # (n_1, r)
    for f in factors[1:]:
        full = (full[:, None, :] * f[None, :, :]).reshape(-1, f.shape[1])  # (n_1..n_k, r)
    return full.sum(1).reshape([f.shape[0] for f in factors])


def _mttkrp(tensor: Tensor, factors: list[Tensor], k: int) -> Tensor:
    """The mode-k unfolding of ``tensor`` times the Khatri-Rao product of the other factors,
    ``(n_k, r)``, contracted one mode at a time and a block of rank columns at a time, so no
    intermediate exceeds about 2**24 entries (the Khatri-Rao product is never formed)."""
    sizes = [n for j, n in enumerate(tensor.shape) if j != k]
    others = [f for j, f in enumerate(factors) if j != k]
    flat = tensor.movedim(k, -1).reshape(sizes[0], -1)  # (n_first, rest * n_k)
    rank = factors[0].shape[1]
    block = max(1, min(rank, 2**24 // flat.shape[1]))
    out = []
    for lo in range(0, rank, block):
        fs = [f[:, lo:lo + block] for f in others]
        work = flat.T @ fs[0]  # (rest * n_k, c)
        for n, f in zip(sizes[1:], fs[1:], strict=True):
            work = (work.reshape(n, -1, f.shape[1]) * f[:, None, :]).sum(0)  # (rest' * n_k, c)
        out.append(work)
    return torch.cat(out, 1)  # (n_k, r)


def cp_als(tensor: Tensor, rank: int, sweeps: int = 10) -> list[Tensor]:
    """CP factors ``(n_k, rank)`` of ``tensor`` by ``sweeps`` alternating least-squares sweeps.

    The start is the HOSVD's leading singular vectors of each unfolding (padded with a fixed
    pseudo-random draw where ``rank`` exceeds a mode). Every sweep solves each factor's least-
    squares problem exactly, so the fit never gets worse from sweep to sweep. At the end the
    columns' norms are balanced across the factors."""
    gen = torch.Generator().manual_seed(0)
    factors = []
    with torch.no_grad():
        for k, n in enumerate(tensor.shape):
            unfolding = tensor.movedim(k, 0).reshape(n, -1)  # (n_k, rest)
            u, s, _ = torch.linalg.svd(unfolding, full_matrices=False)
            start = u[:, :rank] * s[:rank].clamp_min(1e-300) ** (1 / tensor.ndim)
            pad = torch.randn(n, rank - start.shape[1], generator=gen, dtype=tensor.dtype)
            factors.append(torch.cat([start, pad * start.norm() / max(1, start.shape[1])], 1))
        for _ in range(sweeps):
            for k in range(len(factors)):
                gram = torch.ones(rank, rank, dtype=tensor.dtype)
                for j, f in enumerate(factors):
                    if j != k:
                        gram = gram * (f.T @ f)  # (r, r)
                rhs = _mttkrp(tensor, factors, k)  # (n_k, r)
                factors[k] = rhs @ torch.linalg.pinv(gram, hermitian=True)
        norms = torch.stack([f.norm(dim=0) for f in factors])  # (N, r)
        scale = norms.prod(0).clamp_min(1e-300) ** (1 / len(factors)) / norms.clamp_min(1e-300)
        return [f * s for f, s in zip(factors, scale, strict=True)]
