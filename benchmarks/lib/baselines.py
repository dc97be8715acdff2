"""Independent baselines for one TT-compressed linear layer (forward + backward).

Every baseline computes ``y = x @ W`` for ``x`` of shape ``(B, N_in)`` and is differentiable
(through autograd) w.r.t. ``x`` and all of its parameters, so a benchmark can time::

    y = baseline(x)
    y.backward(dy)

TT format ("CoMERA" format): ``W`` has shape ``(N_in, N_out)`` with ``N_in = prod(in_modes)``,
``N_out = prod(out_modes)`` and ``d = len(in_modes) = len(out_modes)``. It is a tensor train over
the ``2d`` modes ``in_modes + out_modes`` (all input modes first), with ``cores[k]`` of shape
``(ranks[k], modes[k], ranks[k + 1])``, ``ranks[0] = ranks[2d] = 1``, and::

    W[i1..id, o1..od] = cores[0][:, i1, :] @ ... @ cores[d - 1][:, id, :]
                        @ cores[d][:, o1, :] @ ... @ cores[2d - 1][:, od, :]

Row/column indices of ``W`` are the row-major flattening of ``(i1..id)`` and ``(o1..od)``.

This module has no import-time side effects: ``opt_einsum`` and ``tltorch`` (which switches the
global tensorly backend when imported) are imported lazily inside the builders that need them.
"""

from __future__ import annotations

import math
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "Baseline",
    "TTMatmul",
    "all_core_baselines",
    "dense_linear",
    "hand_derived_comera",
    "make_cores",
    "naive_core_by_core",
    "opt_einsum_optimal",
    "tensorly_torch_tt",
    "tt_ranks",
    "tt_to_dense",
]


# --------------------------------------------------------------------------------------------
# TT helpers
# --------------------------------------------------------------------------------------------


def tt_ranks(cores: Sequence[Tensor]) -> tuple[int, ...]:
    """Return the ``2d + 1`` TT ranks ``(1, r_1, ..., r_{2d-1}, 1)`` of ``cores``."""
    return (*(int(c.shape[0]) for c in cores), int(cores[-1].shape[2]))


def _check_tt(cores: Sequence[Tensor], in_modes: Sequence[int], out_modes: Sequence[int]) -> None:
    """Raise ``ValueError`` unless ``cores`` is a valid CoMERA TT for the given modes."""
    d = len(in_modes)
    if d < 1 or len(out_modes) != d:
        raise ValueError(f"need len(in_modes) == len(out_modes) >= 1, got {in_modes}, {out_modes}")
    if len(cores) != 2 * d:
        raise ValueError(f"expected {2 * d} cores for d={d}, got {len(cores)}")
    modes = tuple(in_modes) + tuple(out_modes)
    for k, core in enumerate(cores):
        if core.dim() != 3 or core.shape[1] != modes[k]:
            raise ValueError(
                f"core {k} has shape {tuple(core.shape)}, expected (r, {modes[k]}, r')"
            )
        if k > 0 and core.shape[0] != cores[k - 1].shape[2]:
            raise ValueError(f"rank mismatch between cores {k - 1} and {k}")
    if cores[0].shape[0] != 1 or cores[-1].shape[2] != 1:
        raise ValueError("boundary ranks must be 1")


def tt_to_dense(cores: Sequence[Tensor]) -> Tensor:
    """Reconstruct the dense ``(N_in, N_out)`` weight from ``2d`` CoMERA TT cores.

    Reference implementation: contracts the cores left to right (keeping every mode) and
    splits the result into the first ``d`` (input) and last ``d`` (output) modes.
    Differentiable w.r.t. the cores.
    """
    if len(cores) == 0 or len(cores) % 2:
        raise ValueError(f"expected an even, non-zero number of cores, got {len(cores)}")
    d = len(cores) // 2
    modes = [int(c.shape[1]) for c in cores]
    full = cores[0]  # (1, m_0, r_1)
    for core in cores[1:]:
        # (1, m_0, ..., m_{k-1}, r_k) x (r_k, m_k, r_{k+1}) -> (1, m_0, ..., m_k, r_{k+1})
        full = torch.tensordot(full, core, dims=1)
    return full.reshape(math.prod(modes[:d]), math.prod(modes[d:]))


def make_cores(
    in_modes: Sequence[int],
    out_modes: Sequence[int],
    ranks: Sequence[int],
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> list[Tensor]:
    """Random Gaussian CoMERA TT cores (leaf tensors with ``requires_grad=True``).

    All cores share one standard deviation ``s``, chosen so that every entry of the dense
    ``W`` (a sum of ``prod(r_1..r_{2d-1})`` products of ``2d`` Gaussians) has variance
    ``1 / (N_in + N_out)``: ``s**(4d) * prod(r_1..r_{2d-1}) = 1 / (N_in + N_out)``.
    Uses a private generator seeded with ``seed``; the global RNG is untouched.
    """
    modes = tuple(in_modes) + tuple(out_modes)
    d = len(in_modes)
    if d < 1 or len(out_modes) != d:
        raise ValueError(f"need len(in_modes) == len(out_modes) >= 1, got {in_modes}, {out_modes}")
    if len(ranks) != 2 * d + 1 or ranks[0] != 1 or ranks[-1] != 1:
        raise ValueError(f"ranks must have length {2 * d + 1} and start/end with 1, got {ranks}")
    target_var = 1.0 / (math.prod(in_modes) + math.prod(out_modes))
    std = (target_var / math.prod(ranks[1:-1])) ** (1.0 / (4 * d))
    gen = torch.Generator().manual_seed(seed)
    cores = []
    for k, m in enumerate(modes):
        core = torch.randn(ranks[k], m, ranks[k + 1], generator=gen, dtype=torch.float64) * std
        cores.append(core.to(dtype=dtype, device=device).requires_grad_(True))
    return cores


# --------------------------------------------------------------------------------------------
# Baseline container
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Baseline:
    """One baseline: a differentiable ``forward(x) -> y`` plus metadata.

    ``params`` are the trainable leaves the forward depends on (their ``.grad`` is filled by
    ``backward``); ``module`` is the underlying ``nn.Module`` for library baselines, if any.
    """

    name: str
    description: str
    forward: Callable[[Tensor], Tensor]
    params: tuple[Tensor, ...] = ()
    module: nn.Module | None = field(default=None, compare=False)

    def __call__(self, x: Tensor) -> Tensor:
        """Run the forward pass: ``(B, N_in) -> (B, N_out)``."""
        return self.forward(x)

    def run(self, x: Tensor, dy: Tensor) -> Tensor:
        """One training step's layer work: ``y = forward(x); y.backward(dy)``. Returns ``y``."""
        y = self.forward(x)
        y.backward(dy)
        return y

    @property
    def num_params(self) -> int:
        """Number of trainable scalars."""
        return sum(p.numel() for p in self.params)

    def zero_grad(self) -> None:
        """Reset the gradients of ``params`` to ``None``."""
        for p in self.params:
            p.grad = None


# --------------------------------------------------------------------------------------------
# Baselines
# --------------------------------------------------------------------------------------------


def dense_linear(
    in_features: int,
    out_features: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> Baseline:
    """Uncompressed ``nn.Linear(bias=False)``: ``y = x @ weight.T`` with weight ``(N_out, N_in)``.

    The weight is drawn from N(0, 1 / (N_in + N_out)) (same scale as :func:`make_cores`) with a
    private generator.
    """
    layer = nn.Linear(in_features, out_features, bias=False, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = torch.randn(out_features, in_features, generator=gen, dtype=torch.float64)
        layer.weight.copy_(w / math.sqrt(in_features + out_features))
    return Baseline(
        name="dense",
        description=f"torch.nn.Linear({in_features}, {out_features}, bias=False), uncompressed",
        forward=layer,
        params=(layer.weight,),
        module=layer,
    )


def naive_core_by_core(
    cores: Sequence[Tensor], in_modes: Sequence[int], out_modes: Sequence[int]
) -> Baseline:
    """Input-first, core-by-core ``torch.einsum`` contraction (tntorch/t3nsor style).

    ``x`` is reshaped to ``(B, i_1, ..., i_d)`` and a rank axis of size 1 is appended; each input
    core then absorbs the leading input mode (``(B, i_k, ..., i_d, r_k) -> (B, i_{k+1}, ...,
    r_{k+1})``), after which each output core appends one output mode
    (``(B, o_1, ..., o_{j-1}, r) -> (B, o_1, ..., o_j, r')``). Autograd does the backward.
    """
    _check_tt(cores, in_modes, out_modes)
    d = len(in_modes)
    n_out = math.prod(out_modes)
    in_shape = tuple(in_modes)
    cores = tuple(cores)

    def forward(x: Tensor) -> Tensor:
        batch = x.shape[0]
        t = x.reshape(batch, *in_shape, 1)
        for core in cores[:d]:
            t = torch.einsum("bi...r,ris->b...s", t, core)
        for core in cores[d:]:
            t = torch.einsum("b...r,ros->b...os", t, core)
        return t.reshape(batch, n_out)

    return Baseline(
        name="naive_core_by_core",
        description=(
            f"torch.einsum core by core, input cores first then output cores "
            f"(d={d}, ranks={tt_ranks(cores)})"
        ),
        forward=forward,
        params=cores,
    )


def opt_einsum_optimal(
    cores: Sequence[Tensor], in_modes: Sequence[int], out_modes: Sequence[int], batch: int
) -> Baseline:
    """A single ``opt_einsum.contract_expression`` over ``x`` and all ``2d`` cores.

    The path is searched once for the given ``batch`` with ``optimize='optimal'`` (``'dp'`` when
    ``d > 3``, where exhaustive search gets expensive) and run with the torch backend under
    autograd. The returned forward only accepts inputs with exactly ``batch`` rows.
    """
    import opt_einsum

    _check_tt(cores, in_modes, out_modes)
    d = len(in_modes)
    n_out = math.prod(out_modes)
    cores = tuple(cores)
    letters = string.ascii_letters
    if 6 * d + 2 > len(letters):
        raise ValueError(f"d={d} is too large for single-letter einsum indices")
    # Index names: b = batch, i_k = input modes, o_k = output modes, r_0..r_2d = bonds.
    batch_ix, mode_ix, bond_ix = letters[0], letters[1 : 2 * d + 1], letters[2 * d + 1 :]
    x_term = batch_ix + mode_ix[:d]
    core_terms = [bond_ix[k] + mode_ix[k] + bond_ix[k + 1] for k in range(2 * d)]
    equation = ",".join([x_term, *core_terms]) + "->" + batch_ix + mode_ix[d:]
    optimize = "optimal" if d <= 3 else "dp"
    shapes = [(batch, *in_modes), *(tuple(c.shape) for c in cores)]
    expr = opt_einsum.contract_expression(equation, *shapes, optimize=optimize)
    _, info = opt_einsum.contract_path(equation, *shapes, shapes=True, optimize=optimize)
    in_shape = (batch, *in_modes)

    def forward(x: Tensor) -> Tensor:
        return expr(x.reshape(in_shape), *cores, backend="torch").reshape(batch, n_out)

    return Baseline(
        name="opt_einsum_optimal",
        description=(
            f"opt_einsum contract_expression, optimize={optimize!r}, batch={batch}, "
            f"equation {equation}, path {info.path}, est. {float(info.opt_cost):.3g} flops (fwd)"
        ),
        forward=forward,
        params=cores,
    )


def tensorly_torch_tt(
    in_modes: Sequence[int],
    out_modes: Sequence[int],
    rank: int | Sequence[int],
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> Baseline:
    """tensorly-torch's own TT-factorized linear layer (a peer library, not our cores).

    ``tltorch.FactorizedLinear(factorization='BlockTT', implementation='factorized')``: the
    only tensor-train family offered for tensorized matrices is BlockTT, i.e. the TT-*matrix*
    (TTM) format with ``d`` cores of shape ``(r_k, o_k, i_k, r_{k+1})`` (output mode first,
    since tltorch stores the weight as ``(N_out, N_in)``). ``rank`` is its TT-matrix rank (an
    int for a uniform rank, or ``d + 1`` ranks); its forward is one ``einsum`` over ``x`` and
    the ``d`` cores. Factors are re-drawn from a Gaussian so that the dense weight has variance
    ``1 / (N_in + N_out)``, like :func:`make_cores`.
    """
    import tltorch  # imported lazily: this sets tensorly's global backend to pytorch

    in_modes, out_modes = tuple(int(m) for m in in_modes), tuple(int(m) for m in out_modes)
    n_in, n_out = math.prod(in_modes), math.prod(out_modes)
    layer = tltorch.FactorizedLinear(
        in_modes,
        out_modes,
        bias=False,
        factorization="BlockTT",
        rank=rank if isinstance(rank, int) else list(rank),
        implementation="factorized",
        dtype=dtype,
        device=device,
    )
    factors = list(layer.weight.factors)
    ranks = (*(int(f.shape[0]) for f in factors), int(factors[-1].shape[-1]))
    target_var = 1.0 / (n_in + n_out)
    std = (target_var / math.prod(ranks[1:-1])) ** (1.0 / (2 * len(factors)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for f in factors:
            f.copy_(torch.randn(f.shape, generator=gen, dtype=torch.float64) * std)
    params = tuple(layer.parameters())
    n_params = sum(p.numel() for p in params)
    return Baseline(
        name="tensorly_torch_tt",
        description=(
            f"tltorch.FactorizedLinear BlockTT (TT-matrix) in={in_modes} out={out_modes}, "
            f"TT-matrix ranks={ranks}, core shapes (r, o_k, i_k, r'), {n_params} params, "
            f"factorized einsum forward"
        ),
        forward=layer,
        params=params,
        module=layer,
    )


class TTMatmul(torch.autograd.Function):
    """``y = (x @ L) @ R`` with a hand-written GEMM backward (``t = x @ L`` is saved)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, left: Tensor, right: Tensor) -> Tensor:
        t = x @ left
        ctx.save_for_backward(x, left, right, t)
        return t @ right

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, left, right, t = ctx.saved_tensors
        need_x, need_left, need_right = ctx.needs_input_grad
        dx = d_left = d_right = None
        if need_right:
            d_right = t.T @ dy
        if need_x or need_left:
            dt = dy @ right.T
            if need_left:
                d_left = x.T @ dt
            if need_x:
                dx = dt @ left.T
        return dx, d_left, d_right


def _merge_input_cores(cores: Sequence[Tensor]) -> Tensor:
    """Merge input cores (first has rank 1) into ``L`` of shape ``(prod(i_k), r_d)``."""
    left = cores[0].reshape(cores[0].shape[1], cores[0].shape[2])
    for core in cores[1:]:
        r, m, r_next = core.shape
        left = (left @ core.reshape(r, m * r_next)).reshape(-1, r_next)
    return left


def _merge_output_cores(cores: Sequence[Tensor]) -> Tensor:
    """Merge output cores (last has rank 1) into ``R`` of shape ``(r_d, prod(o_k))``."""
    right = cores[-1].reshape(cores[-1].shape[0], cores[-1].shape[1])
    for core in reversed(cores[:-1]):
        r, m, r_next = core.shape
        right = (core.reshape(r * m, r_next) @ right).reshape(r, -1)
    return right


def hand_derived_comera(
    cores: Sequence[Tensor], in_modes: Sequence[int], out_modes: Sequence[int]
) -> Baseline:
    """The CoMERA method hand-written in torch.

    The ``d`` input cores are merged into ``L`` of shape ``(N_in, r_d)`` and the ``d`` output
    cores into ``R`` of shape ``(r_d, N_out)`` with reshape + matmul under autograd; then
    ``y = (x @ L) @ R`` runs through :class:`TTMatmul`, whose backward does the four GEMMs
    explicitly. Core gradients flow from ``dL``/``dR`` through autograd of the merges.
    """
    _check_tt(cores, in_modes, out_modes)
    d = len(in_modes)
    cores = tuple(cores)

    def forward(x: Tensor) -> Tensor:
        left = _merge_input_cores(cores[:d])
        right = _merge_output_cores(cores[d:])
        return TTMatmul.apply(x, left, right)

    return Baseline(
        name="hand_derived_comera",
        description=(
            f"merge cores into L ({math.prod(in_modes)}x{cores[d].shape[0]}) and "
            f"R ({cores[d].shape[0]}x{math.prod(out_modes)}), y = (x @ L) @ R with "
            f"hand-written GEMM backward (d={d}, ranks={tt_ranks(cores)})"
        ),
        forward=forward,
        params=cores,
    )


def all_core_baselines(
    cores: Sequence[Tensor], in_modes: Sequence[int], out_modes: Sequence[int], batch: int
) -> list[Baseline]:
    """The baselines that share ``cores``: naive, opt_einsum and hand-derived CoMERA."""
    return [
        naive_core_by_core(cores, in_modes, out_modes),
        opt_einsum_optimal(cores, in_modes, out_modes, batch),
        hand_derived_comera(cores, in_modes, out_modes),
    ]
