"""The tensor-ring format: TT's cores over ``in_modes + out_modes``, with the chain's ends joined.

Core k carries ``(r{k}, n_k, r{k+1})`` and the last core closes the ring on ``r0``; every link,
the closing one included, is a bond (gate order ``r0, r1, ..., r{n-1}``). A ring of ranks
``(1, r_1, ..., r_{n-1})`` is a TT, so the format holds TT and spends its extra parameters on a
closing bond that lets every core play the same part (Zhao et al. 2016, "Tensor Ring
Decomposition").

Initialisation by TR-SVD (Zhao et al.'s sequential algorithm): the first unfolding
``(n_1) x (n_2 ... n_N)`` is split by a truncated SVD whose ``r_0 r_1`` columns are read as the
pair ``(r_0, r_1)``; the rest, with ``r_0`` moved to its end, is a TT-SVD. The split takes the
largest ``r_0`` the later ranks can carry without loss, so an int rank of at least
:func:`ring_rank_cap` reproduces any weight (at worst as the TT, ``r_0 = 1``).

Rounding: a ring has no canonical form (no orthogonal gauge reaches every bond at once), so
there is no minimal exact rounding. :meth:`TensorRing.round` rounds exactly what can be: the
ring opened at ``r0`` is a chain with two open ends, whose TT rounding (QR and SVD sweeps)
shrinks ``r1 ... r{n-1}``; then the ring opened at ``r1`` shrinks ``r0``. The weight is
unchanged; the bonds are at most what they were, not necessarily the smallest a ring allows.
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
from comera.formats.tt import round_chain
from comera.formats.ttsvd import tt_svd

__all__ = ["TensorRing", "ring_rank_cap", "round_ring", "tr_svd"]


def ring_rank_cap(modes: Sequence[int]) -> int:
    """The largest useful uniform ring rank: the TT-SVD's largest bond. At that rank every
    weight is already a ring (its TT, padded with zeros), so a larger one adds parameters but
    no weight the ring could not already hold."""
    return max((min(math.prod(modes[:k]), math.prod(modes[k:])) for k in range(1, len(modes))),
               default=1)


def _check_ranks(ranks: Ranks, modes: tuple[int, ...]) -> tuple[int, ...]:
    """One rank per ring link ``(r_0, ..., r_{n-1})``, or a ConfigError naming the value."""
    n = len(modes)
    if isinstance(ranks, bool) or not isinstance(ranks, int | Sequence) or isinstance(ranks, str):
        raise ConfigError(f"ranks={ranks!r}; give one int (every ring bond) or a sequence of {n} "
                          f"ints (r0 the closing bond, then r1 ... r{n - 1}).")
    if not isinstance(ranks, Sequence):
        if ranks < 1:
            raise ConfigError(f"ranks={ranks}; a ring rank is an int >= 1.")
        return (min(operator.index(ranks), ring_rank_cap(modes)),) * n
    return rank_sequence(ranks, n, "ring", f"a ring of {n} cores",
                         f"{n} (r0, the closing bond, then r1 ... r{n - 1}) or one int")


class TensorRing(Format):
    """A ring of 3-way cores over all input modes, then all output modes; every link a bond."""

    name, title, exact_decomposition = "tr", "tensor ring", True

    def layout(self, in_modes, out_modes, ranks: Ranks) -> Layout:
        modes = (*in_modes, *out_modes)
        bonds = _check_ranks(ranks, modes)
        n, d = len(modes), len(in_modes)
        names = [f"i{k + 1}" for k in range(d)] + [f"o{k + 1}" for k in range(n - d)]
        cores = tuple((f"r{k}", name, f"r{(k + 1) % n}") for k, name in enumerate(names))
        sizes = dict(zip(names, modes, strict=True)) | {f"r{k}": r for k, r in enumerate(bonds)}
        return Layout(tuple(names[:d]), tuple(names[d:]), cores, tuple(sizes.items()),
                      tuple(f"r{k}" for k in range(n)))

    def plain_decomposition(self, weight: Tensor, layout: Layout) -> list[Tensor]:
        """TR-SVD at the layout's ranks (smaller where the weight's unfoldings are)."""
        modes = (*layout.in_modes, *layout.out_modes)
        return tr_svd(weight.reshape(modes), layout.bond_sizes)

    def round(self, cores: list[Tensor], layout: Layout) -> list[Tensor]:
        return round_ring(list(cores))


def tr_svd(tensor: Tensor, ranks: Sequence[int]) -> list[Tensor]:
    """The TR-SVD of an N-way tensor (N >= 2): cores ``(r_k, n_k, r_{k+1})``, ``r_N = r_0``.

    ``ranks`` caps ``(r_0, ..., r_{N-1})``. The first SVD keeps ``k <= r_0 r_1`` singular
    values, read as the pair ``(r_0', r_1')`` (:func:`split_first`; zero columns fill the last
    few when ``k`` does not factor, which keeps the product exact); the rest is a TT-SVD with
    ``r_0'`` on its last mode. Exact when no nonzero singular value is cut, which an int rank
    of at least :func:`ring_rank_cap` guarantees.
    """
    shape = tuple(tensor.shape)
    n = len(shape)
    if n < 2 or len(ranks) != n:
        raise ConfigError(f"tr_svd needs a tensor of 2+ modes and one rank per link; got shape "
                          f"{shape} and ranks {tuple(ranks)}.")
    dtype = tensor.dtype
    work = tensor.detach()
    if dtype in (torch.float16, torch.bfloat16):
        work = work.float()
    with torch.no_grad():
        u, s, vh = torch.linalg.svd(work.reshape(shape[0], -1), full_matrices=False)
        r0, r1 = split_first(min(ranks[0] * ranks[1], s.numel()), ranks, shape)
        k = min(s.numel(), r0 * r1)
        pad = r0 * r1 - k
        u = torch.nn.functional.pad(u[:, :k], (0, pad))  # (n_1, r0 r1)
        carry = torch.nn.functional.pad(s[:k, None] * vh[:k], (0, 0, 0, pad))  # (r0 r1, rest)
        first = u.reshape(shape[0], r0, r1).permute(1, 0, 2)  # (r0, n_1, r1)
        # (r0, r1, n_2 .. n_N) -> (r1, n_2, ..., n_N, r0): a train whose last mode holds r0
        carry = carry.reshape(r0, r1, -1).permute(1, 2, 0)
        if n == 2:
            rest = [carry.reshape(r1, shape[1], r0)]
        else:
            train = tt_svd(carry.reshape(r1 * shape[1], *shape[2:-1], shape[-1] * r0),
                           list(ranks[2:]))
            last = train[-1].reshape(train[-1].shape[0], shape[-1], r0)
            rest = [train[0].reshape(r1, shape[1], -1), *train[1:-1], last]
    return [core.to(dtype).contiguous() for core in [first, *rest]]


def split_first(k: int, ranks: Sequence[int], shape: Sequence[int]) -> tuple[int, int]:
    """How TR-SVD reads its first ``k`` singular values as ``(r_0', r_1')``, within ``ranks``:
    the largest ``r_0'`` that keeps all ``k`` and leaves a train the later ranks hold exactly
    (at a large enough rank ``r_0' = 1`` always does: the TT); else ``r_0' = min(r_0, k)``.
    ``r_0' r_1'`` may exceed ``k`` by less than ``r_0'`` (zero columns)."""
    n = len(shape)
    for r0 in range(min(ranks[0], k), 0, -1):
        r1 = min(ranks[1], -(-k // r0))
        fits = all(min(r1 * math.prod(shape[1:j]), r0 * math.prod(shape[j:])) <= ranks[j]
                   for j in range(2, n))
        if r0 * r1 >= k and fits:
            return r0, r1
    r0 = max(1, min(ranks[0], k))
    return r0, max(1, min(ranks[1], -(-k // r0)))


def round_ring(cores: list[Tensor], rtol: float = 1e-7) -> list[Tensor]:
    """Exact rounding of float64 ring cores ``(r_k, n_k, r_{k+1})``: the ring opened at ``r_0``
    is rounded as a chain (shrinking ``r_1 ... r_{N-1}``), then the ring opened at ``r_1``
    (shrinking ``r_0``). Only numerically-zero singular values (below ``rtol`` of the largest)
    are dropped, so the weight is unchanged."""
    opened = [cores[0].unsqueeze(0), *cores[1:-1], cores[-1].unsqueeze(-1)]
    chain = round_chain(opened, rtol)
    cores = [chain[0].squeeze(0), *chain[1:-1], chain[-1].squeeze(-1)]
    # open at r1: the chain core 1, ..., core N-1, core 0, with r1 the open ends
    turned = [*cores[1:], cores[0]]
    opened = [turned[0].unsqueeze(0), *turned[1:-1], turned[-1].unsqueeze(-1)]
    chain = round_chain(opened, rtol)
    turned = [chain[0].squeeze(0), *chain[1:-1], chain[-1].squeeze(-1)]
    return [turned[-1], *turned[:-1]]
