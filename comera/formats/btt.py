"""The block tensor-train format (BTT; Qiu et al. 2024, "Compute Better Spent: Replacing Dense
Layers with Structured Matrices"), of which Monarch matrices are the rank-1, two-core case.

x is read as ``(i_1, ..., i_d)`` and y as ``(o_1, ..., o_d)`` (row-major). Core k contracts one
input mode and produces one output mode, batched over the outputs already produced and the
inputs still to come, so it carries::

    core k: (r{k-1}, i_k, i_{k+1} ... i_d, o_1 ... o_k, r{k})      (no r0 on the first core,
                                                                   no r{d} on the last)

The bonds are ``r1 ... r{d-1}``. For two cores, W[(i1, i2), (o1, o2)] = sum_r
core1[i1, i2, o1, r] core2[r, i2, o1, o2]: for each block (i2, o1), the (i1 x o2) block of W
is a rank-r product: the paper's two-core BTT. For d cores the paper's operator takes the
same step per core (one input mode in, one output mode out).

Initialisation: the block SVD, i.e. a TT-SVD batched over the blocks. At step k the carried
tensor is split, for each block (o_1..o_k, i_{k+1}..i_d), as (r{k-1} i_k) x (o_{k+1}..o_d) by a
truncated SVD; U is core k and S Vh is carried on. For two cores this is one rank-r SVD per
block. Exact at full rank, where bond k is ``min(i_1...i_k, o_{k+1}...o_d)`` (the cap of an int
rank). Rounding: the same sweeps as TT rounding (QR left to right, SVD right to left), batched
over each bond's blocks; exact, and each bond ends at the largest numerical rank over its blocks.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch
from torch import Tensor

from comera.errors import ConfigError
from comera.formats.bond_ranks import rank_sequence
from comera.formats.layout import Layout
from comera.formats.registry import Format, Ranks

__all__ = ["BlockTT", "btt_rank_bounds"]


def btt_rank_bounds(in_modes: Sequence[int], out_modes: Sequence[int]) -> tuple[int, ...]:
    """The largest useful BTT bonds ``min(i_1...i_k, o_{k+1}...o_d)``, k = 1 ... d-1 (the ranks
    of the exact block SVD)."""
    d = len(in_modes)
    return tuple(min(math.prod(in_modes[:k]), math.prod(out_modes[k:])) for k in range(1, d))


def _check_ranks(ranks: Ranks, caps: tuple[int, ...]) -> tuple[int, ...]:
    n = len(caps)
    if isinstance(ranks, bool | str) or not isinstance(ranks, int | Sequence):
        raise ConfigError(f"ranks={ranks!r}; give one int (every bond, capped where larger is "
                          f"useless) or a sequence of {n} ints (r1 ... r{n}).")
    if not isinstance(ranks, Sequence):
        if ranks < 1:
            raise ConfigError(f"ranks={ranks}; a BTT rank is an int >= 1.")
        return tuple(min(operator.index(ranks), cap) for cap in caps)
    return rank_sequence(ranks, n, "BTT", f"a BTT of {n + 1} cores",
                         f"{n} (r1 ... r{n}) or one int")


class BlockTT(Format):
    """Block tensor train: d cores, core k trading input mode k for output mode k."""

    name, title, exact_decomposition = "btt", "block tensor train", True

    def layout(self, in_modes, out_modes, ranks: Ranks) -> Layout:
        in_modes, out_modes = tuple(in_modes), tuple(out_modes)
        d = len(in_modes)
        if len(out_modes) != d or d < 2:
            raise ConfigError(
                f"a BTT pairs d >= 2 input modes with d output modes; got in_modes {in_modes} "
                f"and out_modes {out_modes}. Pass as many of each (at least 2; factorize with "
                "comera.formats.factorize.factorize(n, d)), padding with modes of size 1.")
        bonds = _check_ranks(ranks, btt_rank_bounds(in_modes, out_modes))
        ins = tuple(f"i{k + 1}" for k in range(d))
        outs = tuple(f"o{k + 1}" for k in range(d))
        links = [f"r{k}" for k in range(1, d)]
        cores = tuple(tuple(([links[k - 1]] if k else []) + list(ins[k:]) + list(outs[:k + 1])
                            + ([links[k]] if k < d - 1 else []))
                      for k in range(d))
        sizes = (dict(zip(ins, in_modes, strict=True)) | dict(zip(outs, out_modes, strict=True))
                 | dict(zip(links, bonds, strict=True)))
        return Layout(ins, outs, cores, tuple(sizes.items()), tuple(links))

    def plain_decomposition(self, weight: Tensor, layout: Layout) -> list[Tensor]:
        """The block SVD at the layout's bond sizes (smaller where the blocks are). Calibrated,
        it is refitted to the output error (:mod:`comera.formats.whitened`: an input mode sits
        on several cores, so no whitening folds in)."""
        return block_svd(weight, layout.in_modes, layout.out_modes, layout.bond_sizes)

    def round(self, cores: list[Tensor], layout: Layout) -> list[Tensor]:
        return round_btt(list(cores), layout)


def block_svd(weight: Tensor, in_modes: Sequence[int], out_modes: Sequence[int],
              ranks: Sequence[int]) -> list[Tensor]:
    """BTT cores of ``weight`` (in x out) by the block SVD: at step k (1-based), for each block
    (i_{k+1}..i_d, o_1..o_k), a truncated SVD of (r_{k-1} i_k) x (o_{k+1}..o_d) keeping at most
    ``ranks[k-1]`` singular values. Exact when none is cut."""
    d = len(in_modes)
    dtype = weight.dtype
    work = weight.detach()
    if dtype in (torch.float16, torch.bfloat16):
        work = work.float()
    cores: list[Tensor] = []
    with torch.no_grad():
        # carry: (r, i_{k+1} .. i_d, o_1 .. o_d) at step k (0-based), r = 1 at the first
        carry = work.reshape(1, *in_modes, *out_modes)
        for k in range(d - 1):
            r = carry.shape[0]
            n_in = d - k  # input modes left on the carry
            # axes: 0 = r, 1 = i_{k+1} (rows), 2..n_in = the later inputs (blocks), then
            # o_1..o_{k+1} (blocks: core k made o_{k+1}), o_{k+2}..o_d (columns)
            rest_in = list(range(2, n_in + 1))
            done_out = list(range(n_in + 1, n_in + 2 + k))
            open_out = list(range(n_in + 2 + k, n_in + 1 + d))
            block_shape = [carry.shape[a] for a in rest_in + done_out]
            open_shape = [carry.shape[a] for a in open_out]
            mats = carry.permute(*rest_in, *done_out, 0, 1, *open_out)
            mats = mats.reshape(-1, r * in_modes[k], math.prod(open_shape))
            u, s, vh = torch.linalg.svd(mats, full_matrices=False)
            keep = min(ranks[k], s.shape[-1])
            u = u[..., :keep].reshape(*block_shape, r, in_modes[k], keep)
            nb = len(block_shape)
            core = u.permute(nb, nb + 1, *range(nb), nb + 2)  # (r, i_k, blocks.., keep)
            cores.append(core[0] if k == 0 else core)
            sv = (s[..., :keep, None] * vh[..., :keep, :])  # (blocks, keep, open)
            sv = sv.reshape(*block_shape, keep, *open_shape)
            # back to carry order (keep, i_{k+1}..i_d, o_1..o_d)
            n_rest = len(rest_in)
            carry = sv.permute(nb, *range(n_rest), *range(n_rest, nb),
                               *range(nb + 1, nb + 1 + len(open_shape)))
        cores.append(carry)
    return [core.to(dtype).contiguous() for core in cores]


def round_btt(cores: list[Tensor], layout: Layout, rtol: float = 1e-7) -> list[Tensor]:
    """Exact rounding of float64 BTT cores: TT rounding batched over each bond's blocks. Left
    to right, core k is QR'd per block (rows r{k-1}, i_k) and R goes into core k+1; right to
    left, core k+1 is SVD'd per block and bond k keeps the largest number of singular values
    above ``rtol`` of the bond's largest, over its blocks (numerically zero ones only)."""
    cores = list(cores)
    names = layout.cores
    for k, bond in enumerate(layout.bonds):  # bond k joins core k and core k+1
        cores[k], factor, blocks = _split(cores[k], names[k], names[k + 1], bond, "qr")
        cores[k + 1] = _absorb(factor, blocks, cores[k + 1], names[k + 1], bond)
    for k in range(len(layout.bonds) - 1, -1, -1):
        bond = layout.bonds[k]
        cores[k + 1], factor, blocks = _split(cores[k + 1], names[k + 1], names[k], bond, "svd",
                                              rtol)
        cores[k] = _absorb(factor, blocks, cores[k], names[k], bond)
    return cores


def _split(core: Tensor, names: Sequence[str], other: Sequence[str], bond: str, how: str,
           rtol: float = 0.0) -> tuple[Tensor, Tensor, list[str]]:
    """Factor ``core`` across ``bond`` per block (the indices it shares with ``other``):
    ``core = Q M`` (``how="qr"``) or ``core = M Vh`` (``"svd"``), Q or Vh in ``core``'s axis
    order with a new bond size. Returns it, M as (*blocks, bond, new) and the block names."""
    blocks = [n for n in names if n in other and n != bond]
    free = [n for n in names if n not in other]
    size = dict(zip(names, core.shape, strict=True))
    block_shape = [size[n] for n in blocks]
    nb, nf = math.prod(block_shape), math.prod(size[n] for n in free)
    order = [*blocks, *free, bond] if how == "qr" else [*blocks, bond, *free]
    mats = core.permute([names.index(n) for n in order])
    if how == "qr":
        q, r = torch.linalg.qr(mats.reshape(nb, nf, size[bond]))  # (nb, nf, m), (nb, m, bond)
        m = q.shape[-1]
        out = q.reshape(*block_shape, *(size[n] for n in free), m)
        factor = r.transpose(1, 2)  # (nb, bond, m)
    else:
        u, s, vh = torch.linalg.svd(mats.reshape(nb, size[bond], nf), full_matrices=False)
        m = max(1, int((s > rtol * s.max()).sum(-1).max()))
        out = vh[:, :m].reshape(*block_shape, m, *(size[n] for n in free))
        factor = u[..., :m] * s[:, None, :m]  # (nb, bond, m)
    back = [order.index(n) for n in names]
    factor = factor.reshape(*block_shape, *factor.shape[1:])
    return out.permute(back).contiguous(), factor, blocks


def _absorb(factor: Tensor, blocks: list[str], core: Tensor, names: Sequence[str],
            bond: str) -> Tensor:
    """``core`` with its ``bond`` axis mapped by the per-block ``factor`` (*blocks, bond, new)."""
    letters = dict(zip([*names, "new"], "abcdefghijklmnopqrstuvwxyABCDEFGHIJKLMNOPQRSTUVWXY",
                       strict=False))
    term = lambda ix: "".join(letters[i] for i in ix)  # noqa: E731
    out = [("new" if n == bond else n) for n in names]
    eq = f"{term(names)},{term([*blocks, bond, 'new'])}->{term(out)}"
    return torch.einsum(eq, core, factor).contiguous()
