"""TT-SVD (Oseledets 2011) and the matrix <-> tensor-train conversions CoMERA needs.

Two layouts of a weight matrix ``W`` of shape ``(N_in, N_out)`` (used as ``x @ W``, so pass
``nn.Linear.weight.T``):

* TT (CoMERA): ``W`` reshaped row-major to ``(*in_modes, *out_modes)`` and split into ``2d``
  cores ``(r_{k-1}, n_k, r_k)``, all input modes first, then the output modes.
* TT-matrix (TTM): ``d`` cores ``(r_{k-1}, m_k, n_k, r_k)``, one per (row mode, column mode).

The decompositions are initializers: they run without autograd and return fresh contiguous
tensors in the input's dtype and device (half precisions are computed in float32).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from comera.errors import ConfigError, tncomp_errors_as_config
from comera.numbers import as_whole
from tncomp.extend import check_modes

MaxRanks = int | Sequence[int] | None


def _check_modes(modes: Sequence[int], name: str) -> tuple[int, ...]:
    """``modes`` as a non-empty tuple of ints >= 1 (tncomp's one check), or a ConfigError."""
    with tncomp_errors_as_config():
        return check_modes(modes, name)


def _check_product(modes: tuple[int, ...], size: int, name: str, what: str) -> None:
    if math.prod(modes) != size:
        raise ConfigError(
            f"{name} {modes} multiply to {math.prod(modes)}, but the weight has {size} {what}; "
            f"pick modes whose product is {size} (comera.formats.factorize.factorize({size}, "
            f"{len(modes)})) or pad the weight"
        )


def _resolve_ranks(max_ranks: MaxRanks, n_bonds: int) -> list[int | None]:
    """One cap (or None: no cap) per interior bond, or a ConfigError."""
    if max_ranks is None:
        return [None] * n_bonds
    if isinstance(max_ranks, bool):
        raise ConfigError(
            f"max_ranks must be an int >= 1, a sequence of ints or None, got the bool {max_ranks!r}"
        )
    if isinstance(max_ranks, Sequence) and not isinstance(max_ranks, (str, bytes)):
        if len(max_ranks) != n_bonds:
            raise ConfigError(
                f"max_ranks must give one rank per interior bond: expected {n_bonds}, got "
                f"{len(max_ranks)} ({tuple(max_ranks)}); pass {n_bonds} ranks, or one int for all"
            )
        return [_check_rank(rank) for rank in max_ranks]
    return [_check_rank(max_ranks)] * n_bonds


def _check_rank(rank: object) -> int:
    return as_whole(rank, "a TT rank", 1, ConfigError, too_low="; use 1 for the smallest")


def _check_weight(weight: torch.Tensor) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ConfigError(
            f"expected a 2-d weight matrix (N_in, N_out), got {shape}; "
            f"for an nn.Linear pass layer.weight.T"
        )
    return weight


def tt_rank_bounds(modes: Sequence[int]) -> tuple[int, ...]:
    """The largest useful interior TT ranks, ``min(prod(modes[:k]), prod(modes[k:]))``.

    These are the ranks of the exact (untruncated) TT-SVD; larger caps change nothing.
    """
    modes = _check_modes(modes, "modes")
    return tuple(min(math.prod(modes[:k]), math.prod(modes[k:])) for k in range(1, len(modes)))


def tt_svd(tensor: torch.Tensor, max_ranks: MaxRanks) -> list[torch.Tensor]:
    """The TT-SVD of an N-way tensor: N cores ``(r_{k-1}, n_k, r_k)`` with ``r_0 = r_N = 1``.

    Sequential reshape + truncated SVD, carrying ``S @ Vh`` to the right (Oseledets 2011), so
    every core but the last is left-orthonormal. ``max_ranks``: an int caps every interior
    bond, a sequence gives the ``N - 1`` interior caps, None keeps the exact full ranks.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"tt_svd expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.ndim < 1 or tensor.numel() == 0:
        raise ConfigError(
            f"tt_svd expects a non-empty tensor with at least one dimension, "
            f"got shape {tuple(tensor.shape)}"
        )
    if not (tensor.is_floating_point() or tensor.is_complex()):
        raise ConfigError(
            f"tt_svd expects a floating-point tensor, got {tensor.dtype}; convert it with .float()"
        )
    bad = int((~torch.isfinite(tensor.detach())).sum())
    if bad:
        raise ConfigError(
            f"tt_svd got a tensor of shape {tuple(tensor.shape)} with {bad} NaN or infinite "
            "entries; an SVD of it is undefined. Fix or drop the non-finite weights first."
        )
    caps = _resolve_ranks(max_ranks, tensor.ndim - 1)
    dtype = tensor.dtype
    work = tensor.detach()
    if dtype in (torch.float16, torch.bfloat16):
        work = work.float()
    shape = tuple(work.shape)
    cores: list[torch.Tensor] = []
    with torch.no_grad():
        carry = work
        rank = 1
        for k, cap in enumerate(caps):
            unfolding = carry.reshape(rank * shape[k], -1)
            u, s, vh = torch.linalg.svd(unfolding, full_matrices=False)
            new_rank = s.numel() if cap is None else min(cap, s.numel())
            cores.append(u[:, :new_rank].reshape(rank, shape[k], new_rank))
            carry = s[:new_rank, None] * vh[:new_rank]
            rank = new_rank
        cores.append(carry.reshape(rank, shape[-1], 1))
    return [core.to(dtype).clone(memory_format=torch.contiguous_format) for core in cores]


def tt_to_tensor(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Contract TT cores ``(r_{k-1}, n_k, r_k)`` back to the full tensor ``(n_1, ..., n_N)``."""
    if len(cores) == 0:
        raise ConfigError("expected at least one TT core, got none")
    for k, core in enumerate(cores):
        if core.ndim != 3:
            raise ConfigError(
                f"TT core {k} must be 3-d (r_prev, n, r_next), got shape {tuple(core.shape)}"
            )
        left = 1 if k == 0 else cores[k - 1].shape[2]
        if core.shape[0] != left:
            raise ConfigError(
                f"TT core {k} has left rank {core.shape[0]}, expected {left} "
                f"(the right rank of the previous core, 1 for the first)"
            )
    if cores[-1].shape[2] != 1:
        raise ConfigError(f"the last TT core must have right rank 1, got {cores[-1].shape[2]}")
    result = cores[0].reshape(-1, cores[0].shape[2])
    for core in cores[1:]:
        result = (result @ core.reshape(core.shape[0], -1)).reshape(-1, core.shape[2])
    return result.reshape([core.shape[1] for core in cores])


def matrix_to_tt(
    weight: torch.Tensor,
    in_modes: Sequence[int],
    out_modes: Sequence[int],
    max_ranks: MaxRanks,
) -> list[torch.Tensor]:
    """The CoMERA TT cores of ``W`` (N_in, N_out): input-mode cores first, then output-mode cores.

    ``max_ranks`` has ``len(in_modes) + len(out_modes) - 1`` entries if a sequence. At full rank
    (None) ``tt_to_matrix(cores, len(in_modes))`` reproduces ``W`` to float tolerance.
    """
    weight = _check_weight(weight)
    in_modes = _check_modes(in_modes, "in_modes")
    out_modes = _check_modes(out_modes, "out_modes")
    _check_product(in_modes, weight.shape[0], "in_modes", "rows (N_in)")
    _check_product(out_modes, weight.shape[1], "out_modes", "columns (N_out)")
    return tt_svd(weight.reshape(*in_modes, *out_modes), max_ranks)


def tt_to_matrix(cores: Sequence[torch.Tensor], n_in_modes: int) -> torch.Tensor:
    """Contract CoMERA TT cores back to the matrix (N_in, N_out).

    The first ``n_in_modes`` cores carry the input (row) modes, the rest the output modes.
    """
    if (
        isinstance(n_in_modes, bool)
        or not isinstance(n_in_modes, int)
        or not 0 <= n_in_modes <= len(cores)
    ):
        raise ConfigError(
            f"n_in_modes must be an int in [0, {len(cores)}] (the number of cores), "
            f"got {n_in_modes!r}; pass len(in_modes)"
        )
    full = tt_to_tensor(cores)
    n_in = math.prod(full.shape[:n_in_modes])
    return full.reshape(n_in, -1)


def matrix_to_ttm(
    weight: torch.Tensor,
    row_modes: Sequence[int],
    col_modes: Sequence[int],
    max_ranks: MaxRanks,
) -> list[torch.Tensor]:
    """The TT-matrix cores ``(r_{k-1}, m_k, n_k, r_k)`` of ``W`` (M, N).

    ``W`` is reshaped to ``(m_1..m_d, n_1..n_d)``, permuted to ``(m_1, n_1, ..., m_d, n_d)``, each
    pair merged, and TT-SVD'd with ``d - 1`` interior ranks (``max_ranks``).
    """
    weight = _check_weight(weight)
    row_modes = _check_modes(row_modes, "row_modes")
    col_modes = _check_modes(col_modes, "col_modes")
    if len(row_modes) != len(col_modes):
        raise ConfigError(
            f"a TT-matrix needs as many row modes as column modes, got {len(row_modes)} "
            f"{row_modes} and {len(col_modes)} {col_modes}; pad one with modes of size 1"
        )
    _check_product(row_modes, weight.shape[0], "row_modes", "rows (M)")
    _check_product(col_modes, weight.shape[1], "col_modes", "columns (N)")
    cores = tt_svd(paired_modes(weight, row_modes, col_modes), max_ranks)
    return [
        core.reshape(core.shape[0], m, n, core.shape[2])
        for core, m, n in zip(cores, row_modes, col_modes, strict=True)
    ]


def paired_modes(weight: torch.Tensor, row_modes: Sequence[int],
                 col_modes: Sequence[int]) -> torch.Tensor:
    """``W`` (M, N) as the d-way tensor ``(m_1 n_1, ..., m_d n_d)`` a TT-matrix decomposes:
    reshaped to ``(m_1..m_d, n_1..n_d)``, each row mode paired with its column mode."""
    d = len(row_modes)
    order = [axis for k in range(d) for axis in (k, d + k)]
    paired = weight.reshape(*row_modes, *col_modes).permute(order)
    return paired.reshape([m * n for m, n in zip(row_modes, col_modes, strict=True)])


def ttm_to_matrix(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Contract TT-matrix cores ``(r_{k-1}, m_k, n_k, r_k)`` back to the matrix (M, N)."""
    for k, core in enumerate(cores):
        if core.ndim != 4:
            raise ConfigError(
                f"TT-matrix core {k} must be 4-d (r_prev, m, n, r_next), "
                f"got shape {tuple(core.shape)}"
            )
    row_modes = [core.shape[1] for core in cores]
    col_modes = [core.shape[2] for core in cores]
    merged = tt_to_tensor([core.reshape(core.shape[0], -1, core.shape[3]) for core in cores])
    d = len(cores)
    paired = merged.reshape(
        [size for pair in zip(row_modes, col_modes, strict=True) for size in pair]
    )
    order = [2 * k for k in range(d)] + [2 * k + 1 for k in range(d)]
    return paired.permute(order).reshape(math.prod(row_modes), math.prod(col_modes))
