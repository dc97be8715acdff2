"""The primitive steps a plan is made of: views, permute copies, sums and (batched) GEMMs.

Steps read and write numbered slots of a runtime list. They are frozen data: the executor turns
each into a small closure once, so a cached plan runs as a tight loop over torch calls.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class MatView:
    """A slot seen as a (batched) matrix: ``slots[slot].reshape(shape)``, transposed if ``t``.

    ``shape`` is in storage order. A 3-D view has its batch axis at ``batch_axis``: 0 for
    ``(batch, rows, cols)``, 1 for ``(rows, batch, cols)``, a strided batch read as
    ``reshape(shape).permute(1, 0, 2)`` (the matrices keep a unit stride, so BLAS reads them
    in place: a value whose batch indices sit between its row and column indices needs no
    copy)."""

    slot: int
    shape: tuple[int, ...]
    t: bool
    batch_axis: int = 0

    def flipped(self) -> MatView:
        return MatView(self.slot, self.shape, not self.t, self.batch_axis)

    @property
    def batch(self) -> int:
        """The number of matrices (1 for a 2-D view)."""
        return self.shape[self.batch_axis] if len(self.shape) == 3 else 1

    @property
    def stored(self) -> tuple[int, int]:
        """(rows, cols) of each matrix in storage order, before the transpose flag."""
        if len(self.shape) == 3 and self.batch_axis == 1:
            return self.shape[0], self.shape[2]
        r, c = self.shape[-2:]
        return r, c

    @property
    def rows_cols(self) -> tuple[int, int]:
        r, c = self.stored
        return (c, r) if self.t else (r, c)


@dataclass(frozen=True, slots=True)
class MatMul:
    """``slots[dst] = lhs @ rhs`` (torch.mm, or torch.bmm when the views carry a batch axis).

    ``transposed``: run it as ``(rhs^T @ lhs^T)^T`` copied contiguous, the same values in the
    same layout from the other GEMM orientation (autotune sets it where that measured faster).
    """

    dst: int
    lhs: MatView
    rhs: MatView
    flops: int
    nbytes: int
    note: str = ""
    transposed: bool = False

    @classmethod
    def of(cls, dst: int, lhs: MatView, rhs: MatView, itemsize: int, note: str = "") -> MatMul:
        """``lhs @ rhs`` into slot ``dst``, its FLOPs (2 per multiply-add) and the bytes its
        operands and result take."""
        m, k = lhs.rows_cols
        n = rhs.rows_cols[1]
        nb = lhs.batch
        return cls(dst, lhs, rhs, 2 * nb * m * k * n, nb * (m * k + k * n + m * n) * itemsize,
                   note)

    @property
    def reads(self) -> tuple[int, ...]:
        return (self.lhs.slot, self.rhs.slot)

    def describe(self) -> str:
        m, k = self.lhs.rows_cols
        n = self.rhs.rows_cols[1]
        kind = "bmm" if len(self.lhs.shape) == 3 else "gemm"
        batch = f"{self.lhs.batch}x " if kind == "bmm" else ""
        # N/T: the BLAS transpose flag; s: a strided batch (read in place, see MatView)
        ta, tb = (("T" if v.t else "N") + ("s" if v.batch_axis else "")
                  for v in (self.lhs, self.rhs))
        how = " as (B^T A^T)^T" if self.transposed else ""
        return f"{kind} {batch}({m}x{k})@({k}x{n}) {ta}{tb}{how}"


@dataclass(frozen=True, slots=True)
class Permute:
    """``slots[dst] = slots[src].reshape(shape).permute(perm).contiguous()`` (a copy)."""

    dst: int
    src: int
    shape: tuple[int, ...]
    perm: tuple[int, ...]
    nbytes: int
    note: str = ""
    flops: int = 0

    @property
    def reads(self) -> tuple[int, ...]:
        return (self.src,)

    def describe(self) -> str:
        return f"permute {self.shape} by {self.perm}"

    @property
    def swap(self) -> Swap | None:
        """The copy as a swap of two blocks (:func:`as_swap`), or None."""
        return as_swap(self.shape, self.perm)

    @property
    def kind(self) -> str:
        """How fast the copy can run: ``"runs"`` (it moves contiguous runs of at least
        :data:`LONG_RUN` elements: near a plain copy), ``"transpose"`` (a swap the executors run
        as blocked 2-D transposes) or ``"gather"`` (short runs read far apart)."""
        if inner_run(self.shape, self.perm) >= LONG_RUN:
            return "runs"
        return "transpose" if blocked(self.swap) else "gather"


LONG_RUN = 64  # a copy moving runs of this many elements reads and writes whole cache lines
MIN_TRANSPOSE = 64 * 64  # a smaller swap is copied as is (torch's 2-D fast path starts at 60^2)
MAX_LOOP = 512  # a swap of more 2-D transposes than this is copied as is (the loop would cost)


@dataclass(frozen=True, slots=True)
class Swap:
    """A permute copy as one swap of two blocks: ``(lead, x, y, trail) -> (lead, y, x, trail)``
    (sizes in elements). With ``trail == 1`` it is ``lead`` 2-D transposes of ``(x, y)``, which
    the CPU executor runs blocked (:func:`blocked`); the axes a permute moves together are
    merged first."""

    lead: int
    x: int
    y: int
    trail: int


def blocked(swap: Swap | None) -> bool:
    """Whether the CPU executor runs this swap as 2-D transposes (torch's blocked copy) rather
    than one plain copy: no trailing run, blocks large enough to gain, few enough to loop."""
    return (swap is not None and swap.trail == 1 and swap.x * swap.y >= MIN_TRANSPOSE
            and swap.lead <= MAX_LOOP)


def _blocks(shape: Sequence[int], perm: Sequence[int]) -> tuple[list[int], list[int]]:
    """The permute's blocks (axes that stay adjacent and in order, size-1 axes dropped): for
    each output position its block's source rank, and each source block's size."""
    kept = [a for a in range(len(shape)) if shape[a] != 1]
    pos = {a: k for k, a in enumerate(kept)}
    groups: list[list[int]] = []  # blocks of source axes, in output order
    for a in perm:
        if shape[a] == 1:
            continue
        if groups and pos[groups[-1][-1]] + 1 == pos[a]:
            groups[-1].append(a)
        else:
            groups.append([a])
    order = sorted(range(len(groups)), key=lambda g: pos[groups[g][0]])  # source order
    rank = {g: k for k, g in enumerate(order)}
    sizes = [math.prod(shape[a] for a in groups[g]) for g in order]
    return [rank[g] for g in range(len(groups))], sizes


def inner_run(shape: Sequence[int], perm: Sequence[int]) -> int:
    """Elements the copy ``permute(perm)`` of a contiguous ``shape`` moves contiguously: the
    innermost block's size when it stays innermost, else 1."""
    out, sizes = _blocks(shape, perm)
    if not out:
        return 1
    last = len(sizes) - 1
    return sizes[last] if out[-1] == last else 1


def as_swap(shape: Sequence[int], perm: Sequence[int]) -> Swap | None:
    """``permute(perm)`` of a contiguous tensor of ``shape`` as a :class:`Swap`, or None when
    it moves more than two blocks (or none: a plain copy). Size-1 axes are ignored, and axes
    that stay adjacent and in order are merged into one block."""
    out, size = _blocks(shape, perm)
    moved = [k for k, g in enumerate(out) if g != k]
    if len(moved) != 2 or out[moved[0]] != moved[1] or moved[1] != moved[0] + 1:
        return None
    lo = moved[0]
    return Swap(math.prod(size[:lo]), size[lo], size[lo + 1], math.prod(size[lo + 2:]))


@dataclass(frozen=True, slots=True)
class Reshape:
    """``slots[dst] = slots[src].reshape(shape)`` (a view when strides allow)."""

    dst: int
    src: int
    shape: tuple[int, ...]
    note: str = ""
    flops: int = 0
    nbytes: int = 0

    @property
    def reads(self) -> tuple[int, ...]:
        return (self.src,)

    def describe(self) -> str:
        return f"view as {self.shape}"


@dataclass(frozen=True, slots=True)
class Sum:
    """``slots[dst] = slots[src].reshape(shape).sum(dims)``: an index no other tensor carries."""

    dst: int
    src: int
    shape: tuple[int, ...]
    dims: tuple[int, ...]
    flops: int
    nbytes: int
    note: str = ""

    @property
    def reads(self) -> tuple[int, ...]:
        return (self.src,)

    def describe(self) -> str:
        return f"sum {self.shape} over axes {self.dims}"


@dataclass(frozen=True, slots=True)
class Expand:
    """``slots[dst] = slots[src].reshape(view).expand(shape)``: the adjoint of a :class:`Sum`."""

    dst: int
    src: int
    view: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int
    note: str = ""
    flops: int = 0

    @property
    def reads(self) -> tuple[int, ...]:
        return (self.src,)

    def describe(self) -> str:
        return f"broadcast {self.view} to {self.shape}"


Op = MatMul | Permute | Reshape | Sum | Expand


def transpose_gemms(ops: Sequence[Op], positions: Collection[int]) -> tuple[Op, ...]:
    """``ops`` with the GEMMs at ``positions`` marked :attr:`MatMul.transposed`; raises
    ValueError when a position is out of range or not a GEMM."""
    for k in positions:
        if not (isinstance(k, int) and 0 <= k < len(ops) and isinstance(ops[k], MatMul)):
            raise ValueError(f"step {k!r} of {len(ops)} is not a GEMM; only a GEMM can be "
                             "transposed.")
    return tuple(replace(op, transposed=True) if k in positions else op
                 for k, op in enumerate(ops))
