"""The CP (canonical polyadic) format: one factor per mode, all sharing one rank.

W (in x out) reshaped to ``(*in_modes, *out_modes)`` is a sum of r rank-one terms,
``W[n_1..n_N] = sum_r U_1[n_1, r] ... U_N[n_N, r]``: factor k is ``(n_k, r)`` and there is no
core. The one bond r is a hyperedge (carried by every factor), so one gate prunes a whole
rank-one term. It is the leanest format per rank (``r * sum(modes)`` parameters) but has no
closed-form decomposition: :meth:`CP.plain_decomposition` runs a few alternating least-squares
sweeps from an HOSVD start, which is approximate (``exact_decomposition`` is False; calibrated,
the base class's whitened path refits it to the output error), and there is no exact rounding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import tncomp.extend
from comera.errors import ConfigError, tncomp_errors_as_config
from comera.formats.bond_ranks import resolve_bond_ranks
from comera.formats.layout import Layout
from comera.formats.registry import Format, Ranks

__all__ = ["CP", "cp_als", "cp_to_tensor", "khatri_rao"]


class CP(Format):
    """CP: factors ``(n_k, r)`` for every input and output mode, one shared rank r.
    ``ranks``: an int (or a one-element sequence), capped at the largest rank a tensor of these
    modes can have, ``prod(modes) // max(modes)``."""

    name, title, exact_decomposition = "cp", "CP", False

    def layout(self, in_modes, out_modes, ranks: Ranks) -> Layout:
        with tncomp_errors_as_config():
            in_modes = tncomp.extend.check_modes(in_modes, "in_modes")
            out_modes = tncomp.extend.check_modes(out_modes, "out_modes")
        modes = in_modes + out_modes
        (rank,) = resolve_bond_ranks(ranks, [math.prod(modes) // max(modes)], "ranks")
        ins = tuple(f"i{k + 1}" for k in range(len(in_modes)))
        outs = tuple(f"o{k + 1}" for k in range(len(out_modes)))
        cores = tuple((n, "r") for n in ins + outs)
        sizes = (*zip(ins + outs, modes, strict=True), ("r", rank))
        return Layout(ins, outs, cores, sizes, ("r",))

    def plain_decomposition(self, weight: Tensor, layout: Layout) -> list[Tensor]:
        """ALS from an HOSVD start (:func:`cp_als`, its default sweeps)."""
        tensor = weight.detach().to(torch.float64).reshape(*layout.in_modes, *layout.out_modes)
        factors = cp_als(tensor, layout.size("r"), split=len(layout.inputs))
        return [f.to(weight.dtype).contiguous() for f in factors]


def cp_to_tensor(factors: list[Tensor]) -> Tensor:
    """The full tensor ``(n_1, ..., n_N)`` of CP factors ``(n_k, r)``."""
    full = khatri_rao(factors)  # (prod n_k, r)
    return full.sum(1).reshape([f.shape[0] for f in factors])


def khatri_rao(factors: list[Tensor]) -> Tensor:
    """The column-wise Kronecker product of factors ``(n_j, r)``: ``(prod n_j, r)``, the first
    factor's index varying slowest (row-major, as ``reshape`` flattens)."""
    out = factors[0]
    for f in factors[1:]:
        out = (out[:, None, :] * f[None, :, :]).reshape(-1, f.shape[1])
    return out


def _contract_others(m: Tensor, factors: list[Tensor], k: int) -> Tensor:
    """``m`` (n_1, ..., n_p, r) contracted with every factor but k along its mode, r kept
    (the hyperedge): ``(n_k, r)``."""
    work = m.movedim(k, -2)  # (others..., n_k, r)
    for f in (f for j, f in enumerate(factors) if j != k):
        work = torch.einsum("n...r,nr->...r", work, f)
    return work


def _solve_gram(rhs: Tensor, gram: Tensor) -> Tensor:
    """``rhs @ gram^-1`` for the symmetric PSD Gram matrix of a least-squares step: Cholesky
    when it is positive definite (fast), else the pseudo-inverse (the minimum-norm solution)."""
    chol, info = torch.linalg.cholesky_ex(gram)
    if int(info) == 0:
        return torch.cholesky_solve(rhs.T, chol).T
    return rhs @ torch.linalg.pinv(gram, hermitian=True)


def cp_als(tensor: Tensor, rank: int, sweeps: int = 10, split: int | None = None
           ) -> list[Tensor]:
    """CP factors ``(n_k, rank)`` of ``tensor`` by ``sweeps`` alternating least-squares sweeps.

    The start is the HOSVD's leading singular vectors of each unfolding (from its Gram matrix;
    padded with a fixed pseudo-random draw where ``rank`` exceeds a mode). Every sweep solves
    each factor's least-squares problem exactly, so the fit never gets worse from sweep to
    sweep. The tensor is
    read as a matrix (its first ``split`` modes by the rest, default half): the products with
    the data are one matrix product per half per sweep, against the Khatri-Rao product of the
    other half's factors, so no intermediate is larger than the tensor's matrix times ``rank /
    min(rows, columns)``. At the end the columns' norms are balanced across the factors."""
    shape = tuple(tensor.shape)
    split = len(shape) // 2 if split is None else split
    if not 1 <= split < len(shape):
        raise ConfigError(f"split={split}; cp_als reads a tensor of {len(shape)} modes as a "
                          f"matrix of its first split modes, 1 <= split < {len(shape)}.")
    gen = torch.Generator().manual_seed(0)
    factors = []
    with torch.no_grad():
        for k, n in enumerate(shape):
            unfolding = tensor.movedim(k, 0).reshape(n, -1)  # (n_k, rest)
            power, u = torch.linalg.eigh(unfolding @ unfolding.T)  # ascending; a start only
            u, s = u.flip(1), power.flip(0).clamp_min(0).sqrt()  # (n_k, n_k), (n_k,)
            start = u[:, :rank] * s[:rank].clamp_min(1e-300) ** (1 / len(shape))
            pad = torch.randn(n, rank - start.shape[1], generator=gen, dtype=tensor.dtype)
            factors.append(torch.cat([start, pad * start.norm() / max(1, start.shape[1])], 1))
        matrix = tensor.reshape(math.prod(shape[:split]), -1)  # (rows, columns)
        halves = (list(range(split)), list(range(split, len(shape))))
        for _ in range(sweeps):
            for side, own in enumerate(halves):
                other = khatri_rao([factors[j] for j in halves[1 - side]])  # (cols|rows, r)
                m = matrix @ other if side == 0 else matrix.T @ other  # (rows|cols, r)
                m = m.reshape(*(shape[j] for j in own), rank)  # (n_own..., r)
                for pos, k in enumerate(own):
                    gram = torch.ones(rank, rank, dtype=tensor.dtype)
                    for j, f in enumerate(factors):
                        if j != k:
                            gram = gram * (f.T @ f)  # (r, r)
                    rhs = _contract_others(m, [factors[j] for j in own], pos)  # (n_k, r)
                    factors[k] = _solve_gram(rhs, gram)
        norms = torch.stack([f.norm(dim=0) for f in factors])  # (N, r)
        scale = norms.prod(0).clamp_min(1e-300) ** (1 / len(factors)) / norms.clamp_min(1e-300)
        return [f * s for f, s in zip(factors, scale, strict=True)]
