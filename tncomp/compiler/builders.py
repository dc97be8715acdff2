"""Builders for the networks users declare: TT and TT-matrix layers, TT embeddings, einsum."""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Sequence

from tncomp.compiler.einsum import parse_eq
from tncomp.compiler.ir import Dim, Network, Role, Size, TensorSpec, make_network
from tncomp.errors import IRError

Ranks = int | Sequence[int]


def _as_size(value: Size | str, what: str) -> Size:
    if isinstance(value, str):
        return Dim(value)
    if isinstance(value, bool) or not isinstance(value, int | Dim):
        raise IRError(f"{what} is {value!r}; pass an int, a tncomp.Dim or a symbol name.")
    return value


def check_modes(modes: Sequence[int], what: str) -> tuple[int, ...]:
    """``modes`` as a non-empty tuple of ints >= 1 (numpy ints too), or an :class:`IRError`
    naming ``what`` and the bad mode: the one check of a TT layer's modes (comera maps the error
    to its ConfigError)."""
    if isinstance(modes, str | bytes) or not isinstance(modes, Sequence):
        raise IRError(f"{what} is {modes!r} ({type(modes).__name__}); give a sequence of ints "
                      "such as (8, 8, 12).")
    if not modes:
        raise IRError(f"{what} is empty; give at least one mode, e.g. (8, 8, 12).")
    checked = []
    for m in modes:
        try:
            value = operator.index(m) if not isinstance(m, bool) else 0
        except TypeError:
            value = 0
        if value < 1:
            raise IRError(f"{what} has mode {m!r}; modes are ints >= 1.")
        checked.append(value)
    return tuple(checked)


def resolve_ranks(ranks: Ranks, modes: Sequence[int], what: str = "ranks") -> tuple[int, ...]:
    """Full bond list ``(1, r1, ..., r_{n-1}, 1)`` for a train over ``modes``.

    ``ranks`` is a max rank (int, clipped at each bond to what a TT-SVD can reach), the interior
    bonds (length n-1), or all bonds (length n+1, ends 1).
    """
    n = len(modes)
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        if ranks < 1:
            raise IRError(f"{what}={ranks}; a rank is at least 1.")
        bonds = [1]
        for k in range(1, n):
            left, right = math.prod(modes[:k]), math.prod(modes[k:])
            bonds.append(min(ranks, left, right))
        return (*bonds, 1)
    if isinstance(ranks, bool) or not isinstance(ranks, Sequence):
        raise IRError(f"{what}={ranks!r}; give a max rank (int) or a sequence of ints.")
    ranks = tuple(ranks)
    if len(ranks) == n - 1:
        ranks = (1, *ranks, 1)
    if len(ranks) != n + 1:
        raise IRError(
            f"{what} has length {len(ranks)} for {n} cores; give {n + 1} bonds (ends 1), "
            f"the {n - 1} interior ones, or one int max rank."
        )
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise IRError(f"{what} {ranks} holds {r!r}; every rank is an int >= 1.")
    if ranks[0] != 1 or ranks[-1] != 1:
        raise IRError(f"{what} {ranks} must start and end with 1 (the train's open ends).")
    return ranks


def tt_linear(
    in_modes: Sequence[int],
    out_modes: Sequence[int],
    ranks: Ranks,
    batch: Size | str = "B",
) -> Network:
    """The CoMERA TT format: x (B, *in_modes) times a train of 2d cores -> y (B, *out_modes).

    Core k has shape (r_{k-1}, n_k, r_k) over the modes ``in_modes + out_modes`` (all input modes
    first, then all output modes), r_0 = r_2d = 1.
    """
    in_modes = check_modes(in_modes, "in_modes")
    out_modes = check_modes(out_modes, "out_modes")
    if len(in_modes) != len(out_modes):
        raise IRError(
            f"in_modes {in_modes} and out_modes {out_modes} differ in length; the TT format "
            "pairs d input modes with d output modes (pad a mode with 1 to match)."
        )
    d = len(in_modes)
    modes = in_modes + out_modes
    bonds = resolve_ranks(ranks, modes)
    mode_names = [f"i{k + 1}" for k in range(d)] + [f"o{k + 1}" for k in range(d)]
    sizes: dict[str, Size] = {"b": _as_size(batch, "batch")}
    sizes.update(zip(mode_names, modes, strict=True))
    sizes.update((f"r{k}", r) for k, r in enumerate(bonds))
    operands = [("x", ["b", *mode_names[:d]], Role.INPUT)]
    operands += [
        (f"core{k + 1}", [f"r{k}", mode_names[k], f"r{k + 1}"], Role.PARAMETER)
        for k in range(2 * d)
    ]
    return make_network(operands, ("y", ["b", *mode_names[d:]]), sizes)


def ttm_linear(
    in_modes: Sequence[int],
    out_modes: Sequence[int],
    ranks: Ranks,
    batch: Size | str = "B",
) -> Network:
    """The interleaved TT-matrix format: cores (r_{k-1}, m_k, n_k, r_k), x (B, *in_modes)."""
    in_modes = check_modes(in_modes, "in_modes")
    out_modes = check_modes(out_modes, "out_modes")
    if len(in_modes) != len(out_modes):
        raise IRError(
            f"in_modes {in_modes} and out_modes {out_modes} differ in length; a TT-matrix core "
            "carries one input and one output mode (pad a mode with 1 to match)."
        )
    d = len(in_modes)
    bonds = resolve_ranks(ranks, [m * n for m, n in zip(in_modes, out_modes, strict=True)])
    sizes: dict[str, Size] = {"b": _as_size(batch, "batch")}
    sizes.update((f"i{k + 1}", m) for k, m in enumerate(in_modes))
    sizes.update((f"o{k + 1}", n) for k, n in enumerate(out_modes))
    sizes.update((f"r{k}", r) for k, r in enumerate(bonds))
    operands = [("x", ["b", *(f"i{k + 1}" for k in range(d))], Role.INPUT)]
    operands += [
        (f"core{k + 1}", [f"r{k}", f"i{k + 1}", f"o{k + 1}", f"r{k + 1}"], Role.PARAMETER)
        for k in range(d)
    ]
    return make_network(operands, ("y", ["b", *(f"o{k + 1}" for k in range(d))]), sizes)


def ttm_embedding(
    row_modes: Sequence[int],
    col_modes: Sequence[int],
    ranks: Ranks,
    batch: Size | str = "B",
) -> Network:
    """A TT-matrix embedding table looked up by row multi-indices.

    The table has prod(row_modes) rows and prod(col_modes) columns with cores
    (r_{k-1}, m_k, n_k, r_k). A lookup gathers, per looked-up row b, the slice
    ``core_k[:, i_k(b), :, :]`` of every core (``core.index_select(1, ids_k)`` moved to the front),
    so the operands are the gathered slices (B, r_{k-1}, n_k, r_k) joined by the hyperedge ``b``;
    the output is (B, *col_modes). Gradients flow back to the cores through the gather.
    """
    row_modes = check_modes(row_modes, "row_modes")
    col_modes = check_modes(col_modes, "col_modes")
    if len(row_modes) != len(col_modes):
        raise IRError(f"row_modes {row_modes} and col_modes {col_modes} differ in length.")
    d = len(row_modes)
    bonds = resolve_ranks(ranks, [m * n for m, n in zip(row_modes, col_modes, strict=True)])
    sizes: dict[str, Size] = {"b": _as_size(batch, "batch")}
    sizes.update((f"o{k + 1}", n) for k, n in enumerate(col_modes))
    sizes.update((f"r{k}", r) for k, r in enumerate(bonds))
    operands = [
        (f"slice{k + 1}", ["b", f"r{k}", f"o{k + 1}", f"r{k + 1}"], Role.PARAMETER)
        for k in range(d)
    ]
    hyper = {"b"} if d >= 2 else set()
    return make_network(operands, ("y", ["b", *(f"o{k + 1}" for k in range(d))]), sizes, hyper)


def stack_siblings(net: Network, n: int, index: str = "s") -> Network:
    """``n`` copies of ``net`` that share its inputs, as one network: every parameter and the
    output get a leading stack index of size ``n`` (``index``; a fresh name when ``net`` uses
    it already), the inputs are left alone.

    Sibling layers applied to one tensor (attention's q, k and v projections) become one
    contraction ``y[s] = net(x, *params[s])``: the planner joins the input-side steps into one
    wider GEMM (x read once) and runs the per-sibling steps as batched GEMMs over ``s``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise IRError(f"n={n!r}; the number of stacked siblings is an int >= 1.")
    if not any(t.role is Role.PARAMETER for t in net.operands):
        raise IRError("the network has no parameter operand to stack; stack_siblings gives "
                      "every parameter a sibling axis (declare the weights Role.PARAMETER).")
    sizes = net.size_dict
    while index in sizes:
        index += "_"

    def stacked(t: TensorSpec) -> TensorSpec:
        if t.role is Role.INPUT:
            return t
        return TensorSpec(t.name, (index, *t.indices), t.role)

    operands = tuple(stacked(t) for t in net.operands)
    holders = sum(index in t.indices for t in operands) + 1  # and the output
    hyper = net.hyper | {index} if holders > 2 else net.hyper
    return Network(operands, stacked(net.output), ((index, n), *net.sizes), hyper)


def from_eq(eq: str, *shapes: Sequence[Size | str], names: Sequence[str] | None = None) -> Network:
    """A network from an einsum equation and one shape per operand, read as torch.einsum does.

    Letters are indices; sizes are ints, :class:`Dim`, or a symbol name such as ``"B"``.
    Without ``->`` the output is ``...`` (if used) then the letters that appear once, sorted
    (einsum's rule). ``...`` stands for leading axes, right-aligned across operands; an axis of
    size 1 broadcasts against another size. Indices on more than two tensors become
    hyperedges, as in einsum. A letter repeated within one operand (a diagonal or trace, such
    as ``'ii->i'``) has no network over that operand: :func:`tncomp.contract` takes those (it
    plans over the diagonal view), and so does ``parse_eq(eq, *shapes).network()`` from
    :mod:`tncomp.compiler.einsum`.
    """
    parsed = parse_eq(eq, *shapes, names=names)
    for name, term in zip(parsed.names, parsed.terms, strict=True):
        repeated = [i for i, c in Counter(term).items() if c > 1]
        if repeated:
            raise IRError(
                f"index {repeated[0]!r} appears twice on tensor {name!r} in eq {eq!r} (a "
                "diagonal or trace); a network's tensors carry distinct indices: use "
                "tncomp.contract, which plans over the diagonal view, or pass "
                "torch.diagonal(...) of the operand with the index written once."
            )
    return parsed.network()
