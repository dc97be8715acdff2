"""The Tucker format: one factor per mode and a core over all the factor ranks.

W (in x out) reshaped to ``(*in_modes, *out_modes)`` is ``core x_1 U_1 x_2 ... x_N U_N``: factor
k is ``(n_k, a_k)`` and the core is ``(a_1, ..., a_N)``. The bonds are the factor ranks a_k, so a
gate prunes one factor column and the matching core slice. Unlike a chain, every mode's rank is
independent of the others; the price is the core, whose size is the product of all ranks.
Initialisation by truncated HOSVD (De Lathauwer et al. 2000, exact at full rank), exact rounding
by re-orthogonalising the factors and an HOSVD of the core.
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
from comera.formats.whitened import mode_product

__all__ = ["Tucker", "hosvd", "mode_product", "round_tucker"]


class Tucker(Format):
    """Tucker: factors ``(n_k, a_k)`` for every input and output mode, then the core
    ``(a_1, ..., a_N)``. ``ranks``: an int (every a_k, capped at what mode k can use) or one
    rank per mode, input modes first."""

    name, title, exact_decomposition = "tucker", "Tucker", True

    def layout(self, in_modes, out_modes, ranks: Ranks) -> Layout:
        with tncomp_errors_as_config():
            in_modes = tncomp.extend.check_modes(in_modes, "in_modes")
            out_modes = tncomp.extend.check_modes(out_modes, "out_modes")
        modes = in_modes + out_modes
        total = math.prod(modes)
        caps = [min(n, total // n) for n in modes]  # the rank of the mode-k unfolding at most
        bonds = resolve_bond_ranks(ranks, caps, "ranks")
        ins = tuple(f"i{k + 1}" for k in range(len(in_modes)))
        outs = tuple(f"o{k + 1}" for k in range(len(out_modes)))
        links = tuple(f"a{k + 1}" for k in range(len(modes)))
        cores = (*zip(ins + outs, links, strict=True), links)
        sizes = (*zip(ins + outs, modes, strict=True), *zip(links, bonds, strict=True))
        return Layout(ins, outs, cores, sizes, links)

    def plain_decomposition(self, weight: Tensor, layout: Layout) -> list[Tensor]:
        """The truncated HOSVD (:func:`hosvd`) at the layout's ranks."""
        tensor = weight.detach().to(torch.float64).reshape(*layout.in_modes, *layout.out_modes)
        cores = hosvd(tensor, layout.bond_sizes)
        return [c.to(weight.dtype).contiguous() for c in cores]

    def round(self, cores: list[Tensor], layout: Layout) -> list[Tensor]:
        return round_tucker(cores)

    def bond_spectra(self, weight: Tensor, layout: Layout) -> tuple[Tensor, ...]:
        """Per mode, the singular values of the weight tensor's mode-k unfolding (what HOSVD
        truncates there)."""
        tensor = weight.detach().to(torch.float64).reshape(*layout.in_modes, *layout.out_modes)
        return tuple(torch.linalg.svdvals(tensor.movedim(k, 0).reshape(tensor.shape[k], -1))
                     for k in range(tensor.dim()))


def hosvd(tensor: Tensor, ranks: tuple[int, ...]) -> list[Tensor]:
    """The truncated HOSVD of an N-way tensor: factors ``(n_k, a_k)`` (the leading left singular
    vectors of each unfolding, ``a_k = min(ranks[k], rank available)``) and the core, as
    ``[U_1, ..., U_N, core]``. Exact when every ``ranks[k]`` reaches its unfolding's rank."""
    factors = []
    with torch.no_grad():
        for k, rank in enumerate(ranks):
            unfolding = tensor.movedim(k, 0).reshape(tensor.shape[k], -1)  # (n_k, rest)
            u, _, _ = torch.linalg.svd(unfolding, full_matrices=False)
            factors.append(u[:, :rank])  # (n_k, a_k)
        core = tensor
        for k, u in enumerate(factors):
            core = mode_product(core, u.T, k)  # axis k: n_k -> a_k
    return [*factors, core]


def round_tucker(cores: list[Tensor], rtol: float = 1e-7) -> list[Tensor]:
    """Exact rounding of float64 Tucker cores ``[U_1, ..., U_N, core]``: QR of each factor (its
    R moves into the core), then the HOSVD of the core, dropping singular values of each
    unfolding below ``rtol`` times its largest (numerically zero). The weight is unchanged and
    no rank grows; a rank ends at most at its factor's and its unfolding's rank."""
    *factors, core = cores
    factors = list(factors)
    for k, u in enumerate(factors):
        q, r = torch.linalg.qr(u)  # (n_k, q_k), (q_k, a_k)
        factors[k] = q
        core = mode_product(core, r, k)  # axis k: a_k -> q_k
    for k in range(len(factors)):
        unfolding = core.movedim(k, 0).reshape(core.shape[k], -1)
        u, s, _ = torch.linalg.svd(unfolding, full_matrices=False)
        keep = max(1, int((s > rtol * s[0]).sum())) if s.numel() else 1
        core = mode_product(core, u[:, :keep].T, k)  # axis k: q_k -> keep
        factors[k] = factors[k] @ u[:, :keep]  # (n_k, keep)
    return [*factors, core]
