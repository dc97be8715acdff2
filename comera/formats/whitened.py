r"""Calibrated decompositions: cores that minimise the error of a layer's output on calibration
inputs rather than the error of its weight (activation-aware truncation, as SVD-LLM does).

With ``X`` the layer's inputs (n x in_features), ``C = X^T X / n`` their second-moment matrix
(the *gram*) and ``W`` the weight (in x out, ``y = x W``), the mean squared output error of an
approximation ``Ŵ`` is ``tr((W - Ŵ)^T C (W - Ŵ)) = ||S^T (W - Ŵ)||_F^2`` for any ``S`` with
``C = S S^T``. Truncating the *whitened* weight ``S^T W`` and mapping back with ``S^{-T}``
minimises that error; for a plain low-rank factorisation this is SVD-LLM's truncation, optimal by
Eckart-Young, and exact at full rank.

A tensor format splits the input side into modes, and ``S^{-T}`` (dense over every input mode)
does not fold into one core. Two steps, both exact at full rank:

1. **A start**, the one of least output error among the plain decomposition, the format's own
   calibrated starts (TT: the whitened weight split at the bond between the input and the output
   cores, :func:`comera.formats.tt.split_whitened`) and the **Kronecker whitening**: ``C`` is
   approximated by ``C_1 ⊗ ... ⊗ C_d``, one factor per input mode (the partial traces of
   ``C``), with Cholesky factors ``S_k``; mode k of the weight tensor is whitened by ``S_k^T``,
   the format decomposes the result, and ``S_k^{-T}`` folds into the one core that carries input
   mode k. With one input mode (low-rank) this is the full whitening; it is exact whenever ``C``
   is such a product. Formats that carry an input mode on several cores (block TT) have no such
   start.
2. **Refit.** Sweeps over the cores, each minimising the exact output error (``C`` itself, not
   its Kronecker approximation) over that core by conjugate gradients from its current value: a
   core's error is a convex quadratic, so the error never grows, and an exact start stays exact.

:func:`damped` regularises the gram before any of this (a fraction of its mean diagonal on the
diagonal), so directions the calibration inputs never visit keep a small weight and every
Cholesky factor exists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor

from comera.errors import ConfigError
from comera.formats.layout import Layout

__all__ = ["REFIT_ENVIRONMENT", "REFIT_FLOPS", "calibrated_decomposition", "check_gram", "damped",
           "kronecker_start", "mode_grams", "mode_product", "output_cores", "output_error",
           "refit", "refit_output_cores", "solve_output_core", "unfolding_spectra",
           "whiten_input_modes", "whitened_weight", "whitening"]

#: The most floating-point work :func:`refit` spends on one layer by default (its sweeps are
#: cut to fit): each conjugate-gradient step multiplies the gram by the dense weight.
REFIT_FLOPS = 4e10
REFIT_SWEEPS = 2  # sweeps over the cores (each core solved in turn)
REFIT_ITERS = 12  # conjugate-gradient steps per core and sweep


def mode_product(core: Tensor, matrix: Tensor, k: int) -> Tensor:
    """``core x_k matrix``: axis k of ``core`` (size a) contracted with ``matrix`` (m, a)."""
    return torch.tensordot(matrix, core, dims=([1], [k])).movedim(0, k)


def check_gram(gram: Tensor, in_features: int) -> Tensor:
    """``gram`` as a float64 (in_features x in_features) symmetric matrix, else a
    :class:`ConfigError` naming its shape or its non-finite entries."""
    if not isinstance(gram, Tensor) or tuple(gram.shape) != (in_features, in_features):
        shape = tuple(gram.shape) if isinstance(gram, Tensor) else type(gram).__name__
        raise ConfigError(f"a gram (input second-moment matrix) of shape {shape} for a layer of "
                          f"{in_features} input features; it must be ({in_features}, "
                          f"{in_features}).")
    gram = gram.detach().to(torch.float64)
    if not bool(torch.isfinite(gram).all()):
        raise ConfigError("the gram holds NaN or infinite entries: the calibration inputs are "
                          "not finite. Check the calibration batches.")
    return (gram + gram.T) / 2


def damped(gram: Tensor, damping: float) -> Tensor:
    """``gram + damping * mean(diag(gram)) * I`` in float64 (the identity when the gram is zero:
    the inputs say nothing, so every direction counts alike)."""
    gram = gram.detach().to(torch.float64)
    scale = float(gram.diagonal().mean()) if gram.numel() else 0.0
    eye = torch.eye(gram.shape[0], dtype=torch.float64, device=gram.device)
    if not scale > 0:
        return eye
    return gram + damping * scale * eye


def whitening(gram: Tensor) -> Tensor:
    """The lower-triangular ``S`` with ``S S^T = gram`` (float64). A gram that is not positive
    definite to working precision gets a growing jitter on its diagonal until it is."""
    gram = gram.to(torch.float64)
    chol, info = torch.linalg.cholesky_ex(gram)
    if int(info) == 0:
        return chol
    scale = max(float(gram.diagonal().abs().mean()), 1e-300)
    eye = torch.eye(gram.shape[0], dtype=torch.float64, device=gram.device)
    for power in range(-12, 1):
        chol, info = torch.linalg.cholesky_ex(gram + scale * 10.0**power * eye)
        if int(info) == 0:
            return chol
    raise ConfigError("the gram is not positive semi-definite (its Cholesky factor does not "
                      "exist even with a jitter); it is not a matrix of inputs' second moments.")


def mode_grams(gram: Tensor, in_modes: Sequence[int]) -> list[Tensor]:
    """Per input mode k, the partial trace of ``gram`` over the other modes (n_k x n_k): the
    factor ``C_k`` of the Kronecker approximation ``C ≈ C_1 ⊗ ... ⊗ C_d`` (up to scale, which
    whitening and unwhitening cancel)."""
    modes = tuple(in_modes)
    d = len(modes)
    if d == 1:
        return [gram]
    full = gram.reshape(*modes, *modes)
    out = []
    for k in range(d):
        others = [j for j in range(d) if j != k]
        rest = math.prod(modes[j] for j in others)
        moved = full.permute(k, *others, d + k, *(d + j for j in others))
        out.append(torch.einsum("arbr->ab", moved.reshape(modes[k], rest, modes[k], rest)))
    return out


def whiten_input_modes(weight: Tensor, in_modes: Sequence[int],
                       factors: Sequence[Tensor]) -> Tensor:
    """``(S_1^T ⊗ ... ⊗ S_d^T) W``: mode k of ``weight`` (in x out, in = prod(in_modes)) times
    ``factors[k]^T``, as an (in x out) matrix."""
    modes = tuple(in_modes)
    tensor = weight.reshape(*modes, -1)
    for k, s in enumerate(factors):
        tensor = mode_product(tensor, s.T, k)
    return tensor.reshape(weight.shape)


def _input_carriers(layout: Layout) -> list[tuple[int, int]] | None:
    """``(core, axis)`` of the one core carrying each input index, or None when an input index
    sits on several cores (block TT): the Kronecker whitening then cannot fold into the cores."""
    out = []
    for index in layout.inputs:
        carriers = layout.carriers(index)
        if len(carriers) != 1:
            return None
        out.append(carriers[0])
    return out


def output_error(weight: Tensor, approx: Tensor, gram: Tensor) -> float:
    """The root mean squared output error ``sqrt(tr((W - Ŵ)^T C (W - Ŵ)))`` of ``approx`` for
    ``weight`` (both in x out) on inputs of second moments ``gram``."""
    diff = (weight.to(torch.float64) - approx.to(torch.float64))
    return math.sqrt(max(float((diff * (gram.to(torch.float64) @ diff)).sum()), 0.0))


def refit(cores: Sequence[Tensor], layout: Layout, weight: Tensor, gram: Tensor,
          sweeps: int = REFIT_SWEEPS, iters: int = REFIT_ITERS,
          max_flops: float = REFIT_FLOPS) -> list[Tensor]:
    """``cores`` (float64) refitted to the output error on inputs of second moments ``gram``:
    ``sweeps`` passes over the cores, each core moved by ``iters`` conjugate-gradient steps on
    its own (convex, quadratic) least-squares problem from where it is, so the error never
    grows. The passes are cut so the work stays under ``max_flops``; the cores' shapes do not
    change."""
    cores = [c.detach().to(torch.float64) for c in cores]
    w = weight.detach().to(torch.float64)
    c = gram.to(torch.float64)
    step_flops = 2.0 * layout.in_features ** 2 * layout.out_features  # C @ (in x out)
    affordable = int(max_flops // max(step_flops * (iters + 2) * len(cores), 1.0))
    for _ in range(min(sweeps, affordable)):
        for k in range(len(cores)):
            cores[k] = _solve_core(cores, k, layout, w, c, iters)
    return cores


def _solve_core(cores: list[Tensor], k: int, layout: Layout, w: Tensor, c: Tensor,
                iters: int) -> Tensor:
    """Core k after ``iters`` conjugate-gradient steps on ``min ||S^T (W - Ŵ(core k))||^2``,
    the normal equations ``A^T C A x = A^T C W`` with ``A`` the (linear) map core k -> Ŵ."""

    def apply(x: Tensor) -> Tensor:  # A x: the weight with core k = x
        return layout.dense([*cores[:k], x, *cores[k + 1:]])

    _, adjoint = torch.func.vjp(apply, cores[k])  # A^T u (A is linear: the same at any point)

    def normal(x: Tensor) -> Tensor:  # A^T C A x
        return adjoint(c @ apply(x))[0]

    x = cores[k]
    r = adjoint(c @ (w - apply(x)))[0]  # the residual of the normal equations, minus gradient
    rho = float((r * r).sum())
    scale = float((adjoint(c @ w)[0] ** 2).sum())
    if not rho > 1e-24 * max(scale, 1e-300):
        return x
    p = r
    for _ in range(iters):
        q = normal(p)
        curvature = float((p * q).sum())
        if not curvature > 0:
            break
        alpha = rho / curvature
        x = x + alpha * p
        r = r - alpha * q
        rho_next = float((r * r).sum())
        if rho_next <= 1e-24 * max(scale, 1e-300):
            break
        p = r + (rho_next / rho) * p
        rho = rho_next
    return x


def kronecker_start(fmt, weight: Tensor, layout: Layout, gram: Tensor) -> list[Tensor] | None:
    """``fmt``'s plain decomposition of the Kronecker-whitened weight with each ``S_k^{-T}``
    folded into the core carrying input mode k (float64); None when an input mode sits on
    several cores."""
    carriers = _input_carriers(layout)
    if carriers is None:
        return None
    factors = [whitening(g) for g in mode_grams(gram, layout.in_modes)]
    cores = list(fmt.decompose(whiten_input_modes(weight, layout.in_modes, factors), layout))
    for (core, axis), s in zip(carriers, factors, strict=True):
        eye = torch.eye(s.shape[0], dtype=s.dtype, device=s.device)
        s_inv_t = torch.linalg.solve_triangular(s, eye, upper=False).T  # S_k^{-T}
        cores[core] = mode_product(cores[core].to(torch.float64), s_inv_t, axis)
    return cores


def calibrated_decomposition(fmt, weight: Tensor, layout: Layout, gram: Tensor,
                             sweeps: int = REFIT_SWEEPS, starts: Sequence = ()) -> list[Tensor]:
    """Cores of ``fmt`` at ``layout``'s bond sizes (or smaller) for ``weight`` (in x out) that
    minimise the output error on inputs of second moments ``gram`` (already damped, see
    :func:`damped`). Candidate starts: the plain decomposition (``fmt.decompose(weight,
    layout)``), the Kronecker-whitened one (:func:`kronecker_start`) and any a format adds in
    ``starts`` (callables ``(weight, layout, gram) -> cores``, float64); the one of least output
    error is refitted (:func:`refit`). So the result is never worse on these inputs than the
    plain decomposition. Cores come back in ``weight``'s dtype."""
    gram = check_gram(gram, layout.in_features)
    w = weight.detach().to(torch.float64)
    best, best_error = None, math.inf
    plain = lambda w, layout, _gram: fmt.decompose(w, layout)  # noqa: E731
    for start in (plain, partial(kronecker_start, fmt), *starts):
        cores = start(w, layout, gram)
        if cores is None:
            continue
        cores = [c.to(torch.float64) for c in cores]
        at = layout.resized(_bond_sizes(cores, layout))
        error = output_error(w, at.dense(cores), gram)
        if error < best_error:
            best, best_error = (cores, at), error
    cores, at = best
    cores = refit(cores, at, w, gram, sweeps)
    return [c.to(weight.dtype).contiguous() for c in cores]


def _bond_sizes(cores: Sequence[Tensor], layout: Layout) -> dict[str, int]:
    """Each bond's size in ``cores`` (a decomposition may return bonds smaller than asked)."""
    return {bond: int(cores[c].shape[a])
            for bond, (c, a) in zip(layout.bonds, (layout.carriers(b)[0] for b in layout.bonds),
                                    strict=True)}


def unfolding_spectra(tensor: Tensor, splits: Sequence[int]) -> tuple[Tensor, ...]:
    """Per split k, the singular values (float64, descending) of ``tensor`` unfolded as its
    first ``k`` axes by the rest: what truncating a chain's bond k at that unfolding discards."""
    work = tensor.detach().to(torch.float64)
    shape = tuple(work.shape)
    return tuple(torch.linalg.svdvals(work.reshape(math.prod(shape[:k]), -1)) for k in splits)


def whitened_weight(weight: Tensor, layout: Layout, gram: Tensor) -> Tensor:
    """``weight`` (in x out) with each input mode whitened by its Kronecker factor of ``gram``
    (:func:`mode_grams`), float64: the matrix whose truncation errors estimate the output
    errors (exactly, for one input mode)."""
    gram = check_gram(gram, layout.in_features)
    factors = [whitening(g) for g in mode_grams(gram, layout.in_modes)]
    return whiten_input_modes(weight.detach().to(torch.float64), layout.in_modes, factors)


# -- the closed-form refit of the output-side cores (SVD-LLM's layer-wise update) ---------------
#: The most entries of one core's environment (in_features x the other outputs x the core's
#: bonds, float64) :func:`refit_output_cores` builds; a core whose environment is larger (a
#: Tucker core: its bonds are all the ranks) is left as it is.
REFIT_ENVIRONMENT = 2**24


def output_cores(layout: Layout) -> tuple[int, ...]:
    """The cores whose closed-form refit is exact: those carrying no input index, whose output
    indices no other core carries, and whose other indices are bonds shared with another core
    (or of size 1). With the other cores fixed, ``Ŵ[i, rest, o] = sum_b E[i, rest, b] G[b, o]``
    (``E`` the network without that core), so the output error is a least-squares problem in
    the core alone: low-rank's second factor, TT's output cores, Tucker's output factors."""
    found = []
    for k, core in enumerate(layout.cores):
        others = {i for j, c in enumerate(layout.cores) if j != k for i in c}
        if any(i in layout.inputs for i in core):
            continue
        if any(i in others for i in core if i in layout.outputs):
            continue
        if any(i not in others and layout.size(i) != 1 for i in core
               if i not in layout.outputs):
            continue
        found.append(k)
    return tuple(found)


def solve_output_core(cores: Sequence[Tensor], k: int, layout: Layout, weight: Tensor,
                      gram: Tensor) -> Tensor:
    r"""Core ``k`` (one of :func:`output_cores`) minimising the output error
    ``tr((W - Ŵ)^T C (W - Ŵ))`` with every other core fixed, in closed form (float64).

    With ``E`` (in, q, b) the network without core k (q: the other output indices, b: core k's
    bonds) and ``W`` reshaped to (in, q, p) (p: core k's outputs), the error is
    ``sum_q ||S^T (W_q - E_q G)||^2`` (``C = S S^T``), so the optimum solves
    ``(sum_q E_q^T C E_q) G = sum_q E_q^T C W_q``: an (b x b) system, solved by the
    pseudo-inverse (a singular ``C`` leaves directions free; the least-norm solution is taken).
    For low-rank (``W ≈ A B``) this is SVD-LLM's update of ``B`` for fixed ``A``:
    ``B = (A^T C A)^+ A^T C W``. (For fixed ``B`` instead, the optimum ``A = W B^+`` does not
    depend on ``C`` at all: the input-side factor is where the inputs' statistics enter.)"""
    idx = layout.cores[k]
    others = {i for j, c in enumerate(layout.cores) if j != k for i in c}
    mine = [i for i in idx if i in layout.outputs]
    links = [i for i in idx if i not in layout.outputs and i in others]
    rest = [i for i in layout.outputs if i not in mine]
    ids = {name: n for n, name in enumerate(dict(layout.sizes))}
    operands: list = []
    for j, (core, names) in enumerate(zip(cores, layout.cores, strict=True)):
        if j != k:
            operands += [core.to(torch.float64), [ids[i] for i in names]]
    env = torch.einsum(*operands, [ids[i] for i in (*layout.inputs, *rest, *links)])
    n_in = layout.in_features
    q = math.prod(layout.size(i) for i in rest)
    b = math.prod(layout.size(i) for i in links)
    p = math.prod(layout.size(i) for i in mine)
    env = env.reshape(n_in, q, b)  # (in, q, b)
    order = [layout.outputs.index(i) for i in (*rest, *mine)]
    target = weight.to(torch.float64).reshape(n_in, *layout.out_modes)
    target = target.permute(0, *(1 + o for o in order)).reshape(n_in, q, p)  # (in, q, p)
    c = gram.to(torch.float64)
    weighted = (c @ env.reshape(n_in, q * b)).reshape(n_in, q, b)  # C E: (in, q, b)
    normal = torch.einsum("iqa,iqb->ab", env, weighted)  # (b, b)
    right = torch.einsum("iqa,iqp->ap", weighted, target)  # (b, p)
    values, vectors = torch.linalg.eigh((normal + normal.T) / 2)
    keep = values > values.abs().max().clamp_min(1e-300) * 1e-12
    inverse = (vectors[:, keep] / values[keep]) @ vectors[:, keep].T  # the pseudo-inverse
    solution = inverse @ right  # (b, p)
    shape = [layout.size(i) for i in (*links, *mine)]
    solution = solution.reshape(shape)
    dangling = [i for i in idx if i not in layout.outputs and i not in others]  # size-1 ends
    names = [*links, *mine, *dangling]
    solution = solution.reshape(*shape, *(1 for _ in dangling))
    return solution.permute(*(names.index(i) for i in idx)).contiguous()


def refit_output_cores(cores: Sequence[Tensor], layout: Layout, weight: Tensor, gram: Tensor,
                       max_entries: int = REFIT_ENVIRONMENT) -> list[Tensor]:
    """``cores`` with each of their :func:`output_cores` replaced, in turn, by its closed-form
    optimum of the output error on inputs of second moments ``gram``
    (:func:`solve_output_core`), each kept only where the error it gives is lower, so the
    output error never grows. Cores whose environment holds more than ``max_entries`` entries
    are left as they are. The bonds are read from the cores (a decomposition may return smaller
    ones); cores come back in ``weight``'s dtype."""
    gram = check_gram(gram, layout.in_features)
    out = [c.detach().to(torch.float64) for c in cores]
    at = layout.resized(_bond_sizes(out, layout))
    w = weight.detach().to(torch.float64)
    error = output_error(w, at.dense(out), gram)
    for k in output_cores(at):
        links = math.prod(at.size(i) for i in at.cores[k] if i not in at.outputs)
        rest = at.out_features // math.prod(at.size(i) for i in at.cores[k] if i in at.outputs)
        if at.in_features * rest * links > max_entries:
            continue
        trial = [*out[:k], solve_output_core(out, k, at, w, gram), *out[k + 1:]]
        trial_error = output_error(w, at.dense(trial), gram)
        if trial_error < error:
            out, error = trial, trial_error
    return [c.to(weight.dtype).contiguous() for c in out]
