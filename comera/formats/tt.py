"""The tensor-train formats: TT (2d cores over input then output modes) and TT-matrix.

TT: W (in x out) as 2d cores (r_{k-1}, n_k, r_k) over ``in_modes + out_modes``; TT-matrix: d
cores (r_{k-1}, m_k, n_k, r_k). The bonds are the chain's interior links r_1 ... r_{n-1}; the ends
r_0 = r_n = 1 are plain size-1 indices. Initialisation by TT-SVD, exact rounding by QR and SVD
sweeps (:func:`round_chain`).
"""

from __future__ import annotations

import torch
from torch import Tensor

import tncomp.extend
from comera.errors import ConfigError, tncomp_errors_as_config
from comera.formats.layout import Layout
from comera.formats.registry import Format, Ranks
from comera.formats.ttsvd import matrix_to_tt, matrix_to_ttm, paired_modes, tt_svd, tt_to_matrix
from comera.formats.whitened import check_gram, unfolding_spectra, whitened_weight, whitening


def chain_layout(inputs: tuple[str, ...], outputs: tuple[str, ...],
                 carried: list[tuple[str, ...]], sizes: dict[str, int],
                 bonds: tuple[int, ...]) -> Layout:
    """A chain: core k carries (r{k}, *carried[k], r{k+1}); ``bonds`` has the ends (1s)."""
    cores = tuple((f"r{k}", *mid, f"r{k + 1}") for k, mid in enumerate(carried))
    sizes = {**sizes, **{f"r{k}": r for k, r in enumerate(bonds)}}
    return Layout(inputs, outputs, cores, tuple(sizes.items()),
                  tuple(f"r{k}" for k in range(1, len(bonds) - 1)))


def chain_bonds(layout: Layout) -> tuple[int, ...]:
    """A chain layout's bond sizes with the ends: (1, r_1, ..., r_{n-1}, 1)."""
    return (1, *layout.bond_sizes, 1)


def split_whitened(weight: Tensor, layout: Layout, gram: Tensor) -> list[Tensor]:
    """A calibrated start of a TT layer (float64): every input mode sits left of the middle
    bond, so the input cores together are one (in x r) factor ``L`` and the full whitening
    applies there. TT-SVD of ``S^T W`` (``gram = S S^T``) gives the output cores and ``S^T L``;
    ``L = S^{-T} (S^T L)`` is then split into the input cores by a TT-SVD at the layout's input
    bonds. Exact when those bonds are full (the middle bond is SVD-LLM's truncation then)."""
    s = whitening(gram)  # (in, in), lower
    w = weight.detach().to(torch.float64)
    ranks = list(layout.bond_sizes)
    d = len(layout.in_modes)
    cores = tt_svd((s.T @ w).reshape(*layout.in_modes, *layout.out_modes), ranks)
    left = cores[0].reshape(-1, cores[0].shape[-1])  # S^T L: (n_1, r_1), then merged on
    for core in cores[1:d]:
        left = (left @ core.reshape(core.shape[0], -1)).reshape(-1, core.shape[-1])
    left = torch.linalg.solve_triangular(s.T, left, upper=True)  # L = S^{-T} S^T L: (in, r_d)
    middle = left.shape[1]
    split = tt_svd(left.reshape(*layout.in_modes, middle), [*ranks[:d - 1], middle])
    last = torch.tensordot(split[-2], split[-1][..., 0], dims=1)  # (r_{d-1}, n_d, r_d)
    return [*split[:-2], last, *cores[d:]]


class TT(Format):
    """CoMERA's TT format: all input modes, then all output modes, one core each."""

    name, title, exact_decomposition = "tt", "TT", True
    table = "ttm"  # an embedding table of a TT model is a TT-matrix table (TT-Rec's layout)
    calibrated_starts = (split_whitened,)

    def layout(self, in_modes, out_modes, ranks: Ranks) -> Layout:
        modes = tuple(in_modes) + tuple(out_modes)
        with tncomp_errors_as_config():
            bonds = tncomp.extend.resolve_ranks(ranks, modes, "ranks")
        d = len(in_modes)
        names = [f"i{k + 1}" for k in range(d)] + [f"o{k + 1}" for k in range(len(out_modes))]
        return chain_layout(tuple(names[:d]), tuple(names[d:]), [(n,) for n in names],
                            dict(zip(names, modes, strict=True)), bonds)

    def network(self, layout: Layout) -> tncomp.Network:
        return tncomp.tt_linear(layout.in_modes, layout.out_modes, chain_bonds(layout))

    def plain_decomposition(self, weight: Tensor, layout: Layout) -> list[Tensor]:
        """TT-SVD at the layout's bonds (:func:`~comera.formats.ttsvd.matrix_to_tt`)."""
        return matrix_to_tt(weight, layout.in_modes, layout.out_modes, list(layout.bond_sizes))

    def bond_spectra(self, weight: Tensor, layout: Layout) -> tuple[Tensor, ...]:
        """The unfoldings' singular values."""
        modes = (*layout.in_modes, *layout.out_modes)
        return unfolding_spectra(weight.reshape(modes), range(1, len(modes)))

    def whitened_spectra(self, weight: Tensor, layout: Layout,
                         gram: Tensor) -> tuple[Tensor, ...]:
        """A bond from the middle one on has every input mode on its left, so its unfolding of
        the fully whitened ``S^T W`` gives the output-error energies exactly; the bonds among
        the input modes read the Kronecker-whitened weight."""
        modes = (*layout.in_modes, *layout.out_modes)
        d = len(layout.in_modes)
        inner = unfolding_spectra(whitened_weight(weight, layout, gram).reshape(modes),
                                  range(1, d))
        full = whitening(check_gram(gram, layout.in_features)).T @ weight.to(torch.float64)
        return inner + unfolding_spectra(full.reshape(modes), range(d, len(modes)))

    def dense(self, cores: list[Tensor], layout: Layout) -> Tensor:
        """The chain contracted left to right (:func:`~comera.formats.ttsvd.tt_to_matrix`):
        the order of operations TT layers' dense weights have always had."""
        return tt_to_matrix(cores, len(layout.in_modes))

    def round(self, cores: list[Tensor], layout: Layout) -> list[Tensor]:
        return round_chain(cores)


class TTM(Format):
    """The interleaved TT-matrix format: core k carries input mode k and output mode k."""

    name, title, exact_decomposition = "ttm", "TT-matrix", True

    def layout(self, in_modes, out_modes, ranks: Ranks) -> Layout:
        if len(in_modes) != len(out_modes):
            raise ConfigError(f"in_modes {tuple(in_modes)} and out_modes {tuple(out_modes)} "
                              f"differ in length; the {self.title} format pairs d input modes "
                              "with d output modes.")
        pairs = list(zip(in_modes, out_modes, strict=True))
        with tncomp_errors_as_config():
            bonds = tncomp.extend.resolve_ranks(ranks, [m * n for m, n in pairs], "ranks")
        d = len(pairs)
        ins = tuple(f"i{k + 1}" for k in range(d))
        outs = tuple(f"o{k + 1}" for k in range(d))
        sizes = dict(zip(ins, in_modes, strict=True)) | dict(zip(outs, out_modes, strict=True))
        return chain_layout(ins, outs, list(zip(ins, outs, strict=True)), sizes, bonds)

    def network(self, layout: Layout) -> tncomp.Network:
        return tncomp.ttm_linear(layout.in_modes, layout.out_modes, chain_bonds(layout))

    def plain_decomposition(self, weight: Tensor, layout: Layout) -> list[Tensor]:
        """TT-matrix SVD at the layout's bonds (:func:`~comera.formats.ttsvd.matrix_to_ttm`)."""
        return matrix_to_ttm(weight, layout.in_modes, layout.out_modes, list(layout.bond_sizes))

    def bond_spectra(self, weight: Tensor, layout: Layout) -> tuple[Tensor, ...]:
        """The singular values of the paired modes' unfoldings."""
        d = len(layout.in_modes)
        merged = paired_modes(weight, layout.in_modes, layout.out_modes)
        return unfolding_spectra(merged, range(1, d))

    def round(self, cores: list[Tensor], layout: Layout) -> list[Tensor]:
        return round_chain(cores)


def round_chain(cores: list[Tensor], rtol: float = 1e-7) -> list[Tensor]:
    """TT rounding of float64 chain cores: QR sweep left to right, then SVD right to left,
    dropping singular values below ``rtol`` times the largest (numerically zero). The weight is
    unchanged; every bond ends at most at what its neighbours allow."""
    cores = list(cores)
    n = len(cores)
    for k in range(n - 1):
        shape = cores[k].shape
        q, r = torch.linalg.qr(cores[k].reshape(-1, shape[-1]))
        cores[k] = q.reshape(*shape[:-1], q.shape[1])
        cores[k + 1] = torch.tensordot(r, cores[k + 1], dims=1)
    for k in range(n - 1, 0, -1):
        shape = cores[k].shape
        u, s, vh = torch.linalg.svd(cores[k].reshape(shape[0], -1), full_matrices=False)
        keep = max(1, int((s > rtol * s[0]).sum())) if s.numel() else 1
        cores[k] = vh[:keep].reshape(keep, *shape[1:])
        cores[k - 1] = torch.tensordot(cores[k - 1], u[:, :keep] * s[:keep], dims=1)
    return cores

