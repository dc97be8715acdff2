"""Embedding tables held in a weight format, with rank gates, looked up through tncomp plans.

A table (rows x dim) is a gated layer whose layout maps row indices to dim indices
(:class:`~comera.formats.layout.Layout`: rows = prod(row_modes) >= num_embeddings, padded). Any
format whose :attr:`~comera.formats.registry.Format.table` names it can hold one
(:class:`GatedEmbedding`): a lookup deduplicates the ids, gathers every core that carries a row
index at the ids' digits (its row axes merged, one ``index_select``), and contracts the gathered
cores with the rest through a compiled network whose batch ``b`` joins them (a hyperedge); the
cores carrying no row index are used whole. Gradients reach the cores through the gather.

:class:`TTEmbedding` is the TT-matrix table (cores (r_{k-1}, m_k, n_k, r_k), the layout TT and
TT-matrix tables take) with its own lookup:

1. deduplicates the batch's ids (``unique`` + ``inverse``), so a frequent token costs once
   (in eager mode; under ``torch.compile`` every id is looked up, without data-dependent shapes);
2. merges the gated cores pairwise, which makes the per-row slices small (at the paper's ranks,
   512 and 1,536 floats instead of 8,192): when the batch's digit pairs cover little of a pair's
   (m_a*m_b) rows, only those pairs are merged, as one batched matmul grouped by the digit of
   the core with the larger slices (so that core is never gathered: at 8,192 Zipf ids on the
   10M-row Criteo table, 216 x 30 padded rows instead of 210 x 216); otherwise, and
   under ``torch.compile``, the whole table is merged by a planned tncomp contraction;
3. gathers one slice per unique id from each merged table and contracts them with a compiled
   ``tncomp.ttm_embedding`` network (a batched chain over the hyperedge ``b``);
4. gathers the rows back by ``inverse``; ``padding_idx`` rows are zero and get no gradient.

:func:`embedding_class` picks the class for a table format; :func:`table_format` says which
format a layer kind's tables take.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

import tncomp
from comera.errors import ConfigError, LookupIndexError
from comera.formats.factorize import factorize, suggest_padded_size
from comera.formats.layout import Layout
from comera.formats.registry import Format, get_format, table_formats
from comera.formats.ttsvd import ttm_to_matrix
from comera.layers.linear import (
    DEFAULT_TAU,
    GatedLayer,
    Ranks,
    check_features,
    check_finite_weight,
    check_tau,
    load_cores_,
)
from comera.lean.recompute import recomputed_in_backward

_MERGE_EQ = "pimq,qjnr->ijpmnr"  # two TT-matrix cores -> one table over (m1 m2) x (n1 n2)


# Regather a gathered slice only when it is this many times its table: kept, the table is extra
# bytes at the backward's peak (a lone lookup on the Criteo table, whose used digit pairs make a
# table almost as large as the slices, peaked 2.1 MiB higher with any ratio above 1).
_REGATHER_MIN_RATIO = 4


def _regathered_in_backward(gathers: Sequence[tuple[Tensor, Tensor, Tensor]]):
    """While the lookup's contraction runs: autograd saves each gathered slice of ``gathers``
    ``(slice, table, digits)`` at least ``_REGATHER_MIN_RATIO`` times its table as the table and
    digits, and the backward gathers it again
    (:func:`comera.lean.recompute.recomputed_in_backward`).

    The slices are U rows of each (merged) table, the tables at most m_a*m_b rows: at the paper
    transformer's batch 32 (about 3,700 distinct ids), 30 MiB of slices that live from the
    forward to the end of the backward, against about 1 MiB of tables. A gather is a copy, so
    the backward sees the same values. Not used under torch.compile (traced lookups take whole
    tables)."""
    return recomputed_in_backward(
        [(t, functools.partial(torch.index_select, table, 0, digits))
         for t, table, digits in gathers if t.numel() >= _REGATHER_MIN_RATIO * table.numel()])


def _merge_pair_rows(first: Tensor, second: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """Merged slices of two TT-matrix cores at the digit pairs ``(a[p], b[p])`` only:
    (P, r0, n1*n2, r2), row p equal to row ``a[p] * m2 + b[p]`` of the whole merged table.

    One batched matmul grouped by the digit of the core with the larger slices: that core is
    used as it is stored, the other's slices are gathered into a zero-padded (groups, slots)
    layout, so the work is groups x (most pairs sharing one digit), not m1 x m2."""
    r0, m1, n1, r1 = first.shape
    _, m2, n2, r2 = second.shape
    p = a.shape[0]
    if r0 * n1 > n2 * r2:  # first has the larger slices: merge the reversed chain, group by a
        rows = _merge_pair_rows(second.permute(3, 1, 2, 0), first.permute(3, 1, 2, 0), b, a)
        rows = rows.reshape(p, r2, n2, n1, r0)  # (P, r2, n2, n1, r0)
        return rows.permute(0, 4, 3, 2, 1).reshape(p, r0, n1 * n2, r2)
    counts = torch.bincount(b, minlength=m2)  # (m2,) pairs per digit of the grouped core
    slots = int(counts.max())
    order = torch.argsort(b, stable=True)
    starts = counts.cumsum(0) - counts  # (m2,)
    slot = torch.empty_like(b, dtype=torch.long)  # b may be int32 (as nn.Embedding takes)
    slot[order] = torch.arange(p, device=b.device) - starts[b[order]]
    where = b * slots + slot  # (P,) position in the padded (m2 * slots) layout
    left = first.permute(1, 0, 2, 3).reshape(m1, r0 * n1, r1).index_select(0, a)  # (P, r0 n1, r1)
    padded = left.new_zeros(m2 * slots, r0 * n1, r1).index_copy(0, where, left)
    right = second.permute(1, 0, 2, 3).reshape(m2, r1, n2 * r2)  # (m2, r1, n2 r2)
    out = torch.bmm(padded.reshape(m2, slots * r0 * n1, r1), right)  # (m2, S r0 n1, n2 r2)
    out = out.reshape(m2 * slots, r0, n1, n2 * r2).index_select(0, where)  # (P, r0, n1, n2 r2)
    return out.reshape(p, r0, n1 * n2, r2)


def _mixed_radix_strides(modes: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for m in reversed(modes):
        strides.append(acc)
        acc *= m
    return list(reversed(strides))


def _traced() -> bool:
    """Whether this lookup is being traced (``torch.compile``) or captured into a CUDA graph:
    then it runs with no data-dependent Python (no ``unique``, no ``int()`` of a tensor), since
    each reads the device back to the host, which a trace cannot follow and a capture forbids."""
    return torch.compiler.is_compiling() or (
        torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())


ID_DTYPES = (torch.int64, torch.int32)  # what nn.Embedding takes


def check_ids(ids: Any, who: str) -> None:
    """``ids`` is a tensor of int64 or int32 ids, as ``nn.Embedding`` takes; else a
    :class:`ConfigError` naming the dtype and the fix (smaller integer types are refused at
    the door, as ``nn.Embedding`` refuses them)."""
    if not isinstance(ids, Tensor) or ids.dtype not in ID_DTYPES:
        got = ids.dtype if isinstance(ids, Tensor) else type(ids).__name__
        raise ConfigError(f"{who} takes integer ids of dtype torch.int64 or torch.int32, as "
                          f"nn.Embedding does; got {got}: pass ids.long().")


def _batch_label(layout: Layout) -> str:
    """An index name for the lookup's batch that no index of ``layout`` has."""
    taken = dict(layout.sizes)
    b = "b"
    while b in taken:
        b = "_" + b
    return b


class GatedEmbedding(GatedLayer):
    """``nn.Embedding`` with its table (rows x dim) held in a registered format, rank gates on
    its bonds (see the module docstring). ``format``: any format that holds tables
    (:func:`comera.formats.registry.table_formats`); ``row_modes`` / ``col_modes``: how the
    padded rows and the dim factor (a missing side is factorised, ``d`` modes when both are; a
    format that uses no modes, plain low-rank, takes none)."""

    #: The format a subclass is fixed to (TTEmbedding: "ttm"); None: any.
    fixed_format: str | None = None

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 row_modes: Sequence[int] | None = None, col_modes: Sequence[int] | None = None,
                 ranks: Ranks = 16, padding_idx: int | None = None, tau: float = DEFAULT_TAU,
                 d: int = 3, *, format: Format | str | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        self._setup(num_embeddings, embedding_dim, row_modes, col_modes, ranks, padding_idx,
                    tau, d, format, dtype, device)

    def _setup(self, num_embeddings, embedding_dim, row_modes, col_modes, ranks, padding_idx,
               tau, d, format, dtype, device) -> None:
        """Check every argument, then build the table's layout, cores and plans."""
        self.num_embeddings = check_features("num_embeddings", num_embeddings)
        self.embedding_dim = check_features("embedding_dim", embedding_dim)
        if format is None and self.fixed_format is None:
            raise ConfigError(f"{type(self).__name__} takes format=..., the format its table is "
                              f"held in: one of {', '.join(table_formats())}.")
        fmt = get_format(format if format is not None else self.fixed_format)
        if self.fixed_format is not None and fmt.name != self.fixed_format:
            raise ConfigError(f"{type(self).__name__} is the {self.fixed_format!r} table, got "
                              f"format {fmt.name!r}; use GatedEmbedding for other formats.")
        if fmt.table is None:
            raise ConfigError(f"format {fmt.name!r} holds no embedding tables; choose one of "
                              f"{', '.join(table_formats())}.")
        if not fmt.uses_modes:
            if row_modes is not None or col_modes is not None:
                raise ConfigError(f"format {fmt.name!r} uses no modes, got row_modes="
                                  f"{row_modes!r}, col_modes={col_modes!r}; leave them out.")
            row_modes, col_modes = (num_embeddings,), (embedding_dim,)
        if row_modes is None:
            n = len(tuple(col_modes)) if col_modes is not None else d
            row_modes = factorize(suggest_padded_size(num_embeddings, n), n)
        if col_modes is None:
            col_modes = factorize(embedding_dim, len(tuple(row_modes)))
        self.row_modes = tuple(int(m) for m in row_modes)
        self.col_modes = tuple(int(n) for n in col_modes)
        self._check_mode_counts()
        if math.prod(self.row_modes) < num_embeddings:
            raise ConfigError(
                f"row_modes {self.row_modes} cover {math.prod(self.row_modes)} rows, fewer than "
                f"num_embeddings={num_embeddings}; pick modes whose product is at least "
                f"{num_embeddings} (e.g. {factorize(suggest_padded_size(num_embeddings, d), d)})."
            )
        if math.prod(self.col_modes) != embedding_dim:
            raise ConfigError(f"col_modes {self.col_modes} multiply to "
                              f"{math.prod(self.col_modes)}, not embedding_dim={embedding_dim}.")
        if padding_idx is not None:
            if padding_idx < 0:
                padding_idx += num_embeddings
            if not 0 <= padding_idx < num_embeddings:
                raise ConfigError(f"padding_idx={padding_idx} is outside [0, {num_embeddings}).")
        self.padding_idx = padding_idx
        # GatedLayer reads these names for sizes and reprs (the layout's in_features is the
        # padded row count).
        self.in_features, self.out_features = num_embeddings, embedding_dim
        layout = fmt.layout(self.row_modes, self.col_modes, ranks)
        GatedLayer.__init__(self, layout, fmt, False, check_tau(tau), dtype, device)
        self._gaussian_init_()
        self.build_compiled()

    def _check_mode_counts(self) -> None:
        """A subclass's own rule on the numbers of modes (nothing by default: the format's
        layout refuses what it cannot hold)."""

    # -- structure ------------------------------------------------------------------------------
    def _network(self) -> tncomp.Network:
        """The lookup: every core carrying a row index gathered (its row indices replaced by
        the batch ``b``), the others whole; output (b, *col indices)."""
        layout = self.layout
        b = _batch_label(layout)
        rows = set(layout.inputs)
        operands = [(f"core{k + 1}", [b, *(i for i in core if i not in rows)]
                     if rows & set(core) else list(core), tncomp.Role.PARAMETER)
                    for k, core in enumerate(layout.cores)]
        counts = Counter(i for _, ix, _ in operands for i in ix)
        counts.update([b, *layout.outputs])
        sizes = {b: tncomp.Dim("B"), **{i: s for i, s in layout.sizes if i not in rows}}
        return tncomp.make_network(operands, ("y", [b, *layout.outputs]), sizes,
                                   [i for i, n in counts.items() if n > 2])

    # -- compute --------------------------------------------------------------------------------
    def forward(self, ids: Tensor) -> Tensor:
        """Rows of the table at integer ``ids`` (any shape): a tensor of shape
        ``(*ids.shape, embedding_dim)``, like ``nn.Embedding``.

        Each distinct id is reconstructed once from its digit slices of the cores; the rows of
        ``padding_idx`` are zero. An id outside ``[0, num_embeddings)`` raises
        :class:`LookupIndexError`."""
        check_ids(ids, type(self).__name__)
        if ids.device != self.cores[0].device:
            raise ConfigError(f"{type(self).__name__}: the ids are on {ids.device}, the cores on "
                              f"{self.cores[0].device}; move one to the other, e.g. "
                              f"ids.to('{self.cores[0].device}').")
        flat = ids.reshape(-1)
        if flat.numel() == 0 or ids.device.type == "meta":  # meta: shapes only
            return self.cores[0].new_zeros(*ids.shape, self.embedding_dim)
        device = ids.device.type
        # as nn.Embedding, the rows come in the table's dtype under autocast: no low precision
        exact = (torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device)
                 else contextlib.nullcontext())
        with exact:
            if _traced():
                # no data-dependent Python (no unique, no int() of a tensor); one row per id,
                # and the range check runs as an op (a RuntimeError when it fails)
                torch._assert_async(((flat >= 0) & (flat < self.num_embeddings)).all(),
                                    f"{type(self).__name__}: an id is out of range; ids must "
                                    f"lie in [0, {self.num_embeddings}).")
                rows = self._rows(flat)
            else:
                self._check_range(flat)
                unique, inverse = torch.unique(flat, return_inverse=True)
                rows = self._rows(unique).index_select(0, inverse)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def _check_range(self, flat: Tensor) -> None:
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi >= self.num_embeddings:
            bad = lo if lo < 0 else hi
            raise LookupIndexError(f"id {bad} is out of range for a table of "
                                   f"{self.num_embeddings} rows; ids must lie in "
                                   f"[0, {self.num_embeddings}).")

    def _rows(self, ids: Tensor) -> Tensor:
        """The table rows at the 1-d ``ids`` (in range): (len(ids), embedding_dim)."""
        layout = self.layout
        strides = dict(zip(layout.inputs, _mixed_radix_strides(self.row_modes), strict=True))
        gathered = []
        for core, names in zip(self.gated_cores(), layout.cores, strict=True):
            axes = [k for k, i in enumerate(names) if i in strides]
            if not axes:
                gathered.append(core)
                continue
            rest = [k for k in range(core.dim()) if k not in axes]
            # the core's row digits as one mixed-radix number over its row axes
            index = torch.zeros_like(ids)
            for k in axes:
                digit = torch.div(ids, strides[names[k]], rounding_mode="floor") % core.shape[k]
                index = index * core.shape[k] + digit
            merged = core.permute(*axes, *rest).reshape(-1, *(core.shape[k] for k in rest))
            gathered.append(merged.index_select(0, index))  # (U, *rest)
        rows = self.compiled()(*gathered).reshape(ids.shape[0], self.embedding_dim)
        return self._pad(rows, ids)

    def _pad(self, rows: Tensor, ids: Tensor) -> Tensor:
        """``rows`` with the rows of ``padding_idx`` zero (no gradient reaches them)."""
        if self.padding_idx is not None:
            rows = rows * (ids != self.padding_idx).to(rows.dtype).unsqueeze(1)
        return rows

    def to_dense(self) -> Tensor:
        """The table as ``nn.Embedding.weight``: (num_embeddings, embedding_dim)."""
        return self._unpadded(self.layout.dense(self.gated_cores()))

    def _unpadded(self, table: Tensor) -> Tensor:
        """The padded ``table``'s first num_embeddings rows, the padding row zero."""
        table = table[: self.num_embeddings]
        if self.padding_idx is not None:
            table = table.clone()
            table[self.padding_idx] = 0
        return table

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, ranks: Ranks = 16,
                       row_modes: Sequence[int] | None = None,
                       col_modes: Sequence[int] | None = None, tau: float = DEFAULT_TAU,
                       d: int = 3, **options) -> GatedEmbedding:
        """A table initialised by the format's decomposition of a trained table (rows
        zero-padded; exact at full rank where the format's is), or randomly where the format
        has none. ``options``: ``format`` (GatedEmbedding) and the class's other keywords."""
        if not isinstance(embedding, nn.Embedding):
            raise ConfigError(f"from_embedding takes an nn.Embedding, got "
                              f"{type(embedding).__name__}.")
        check_finite_weight(embedding, embedding.weight)
        w = embedding.weight.detach()
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, row_modes, col_modes,
                    ranks, embedding.padding_idx, tau, d, dtype=w.dtype, device=w.device,
                    **options)
        layout = layer.layout
        padded = torch.zeros(layout.in_features, w.shape[1], dtype=w.dtype, device=w.device)
        padded[: w.shape[0]] = w
        cores = layer.format.decompose(padded, layout)
        if cores is not None:
            load_cores_(layer, cores, None)
        return layer

    def extra_repr(self) -> str:
        own = "" if self.fixed_format is not None else f"format={self.format.name!r}, "
        return (f"{self.num_embeddings}, {self.embedding_dim}, {own}row_modes={self.row_modes}, "
                f"col_modes={self.col_modes}, ranks={self.ranks}, padding_idx={self.padding_idx}")


class TTEmbedding(GatedEmbedding):
    """``nn.Embedding`` with its table stored as a gated TT-matrix (see the module docstring):
    the table of the TT and TT-matrix formats."""

    fixed_format = "ttm"

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 row_modes: Sequence[int] | None = None, col_modes: Sequence[int] | None = None,
                 ranks: Ranks = 16, padding_idx: int | None = None, tau: float = DEFAULT_TAU,
                 d: int = 3, merge_pairs: bool = True, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, *, format: Format | str = "ttm"):
        self.merge_pairs = bool(merge_pairs)
        self._setup(num_embeddings, embedding_dim, row_modes, col_modes, ranks, padding_idx,
                    tau, d, format, dtype, device)

    def _check_mode_counts(self) -> None:
        if len(self.row_modes) != len(self.col_modes):
            raise ConfigError(f"row_modes {self.row_modes} and col_modes {self.col_modes} differ "
                              "in length; each TT-matrix core carries one of each.")

    # -- structure ------------------------------------------------------------------------------
    def groups(self) -> list[tuple[int, ...]]:
        """Which cores are merged before the lookup: pairs, or one core each."""
        d = len(self.cores)
        if not self.merge_pairs:
            return [(k,) for k in range(d)]
        return [tuple(range(k, min(k + 2, d))) for k in range(0, d, 2)]

    def _structure(self) -> tuple:
        return tuple(self.groups())

    def _network(self) -> tncomp.Network:
        groups = self.groups()
        rows = [math.prod(self.row_modes[k] for k in g) for g in groups]
        cols = [math.prod(self.col_modes[k] for k in g) for g in groups]
        bonds = [1] + [int(self.cores[g[-1]].shape[-1]) for g in groups]
        return tncomp.ttm_embedding(rows, cols, bonds)

    # -- compute --------------------------------------------------------------------------------
    def _merges(self) -> list[tncomp.CompiledNetwork | None]:
        """Per group, the compiled pairwise merge of its two cores (None for a single core);
        held by the layer like ``compiled()``, so a traced forward looks nothing up in tncomp."""
        shapes = self.plan_key()
        if getattr(self, "_merges_for", None) != shapes:
            self._merge_nets = [
                tncomp.compile(tncomp.from_eq(_MERGE_EQ, tuple(self.cores[g[0]].shape),
                                              tuple(self.cores[g[1]].shape)),
                               **self.compile_options) if len(g) == 2 else None
                for g in self.groups()]
            self._merges_for = shapes
        return self._merge_nets

    def merged_tables(self) -> list[Tensor]:
        """Per group, the table (M_g, r_in, N_g, r_out) whose rows are gathered by id digits."""
        cores = self.gated_cores()
        tables = []
        for group, merge in zip(self.groups(), self._merges(), strict=True):
            first = cores[group[0]]
            if merge is None:
                tables.append(first.permute(1, 0, 2, 3).contiguous())
                continue
            second = cores[group[1]]
            r0, m1, n1, _ = first.shape
            _, m2, n2, r2 = second.shape
            merged = merge(first, second)  # (m1, m2, r0, n1, n2, r2)
            tables.append(merged.reshape(m1 * m2, r0, n1 * n2, r2))
        return tables

    def build_compiled(self) -> None:
        """Build the lookup's compiled network and the pairwise merges now (see
        :meth:`GatedLayer.build_compiled`)."""
        super().build_compiled()
        self._merges()

    def __getstate__(self):  # compiled merges hold generated code, as compiled() does
        state = super().__getstate__()
        state["_merge_nets"] = None
        state["_merges_for"] = None
        return state

    def _rows(self, ids: Tensor) -> Tensor:
        """The table rows at the 1-d ``ids`` (in range): (len(ids), embedding_dim)."""
        if _traced():  # whole tables: no data-dependent shapes
            tables = self.merged_tables()
        else:
            cores = self.gated_cores()
            tables = [None if len(g) == 2 else cores[g[0]].permute(1, 0, 2, 3).contiguous()
                      for g in self.groups()]
        slices: list[Tensor] = []
        gathers: list[tuple[Tensor, Tensor, Tensor]] = []
        strides = _mixed_radix_strides(self.row_modes)
        for k, (group, table) in enumerate(zip(self.groups(), tables, strict=True)):
            stride = strides[group[-1]]
            size = math.prod([self.row_modes[j] for j in group])
            digits = torch.div(ids, stride, rounding_mode="floor") % size
            if table is None:  # a pair, merged now: only its used rows when that is cheaper
                table, digits = self._pair_table(cores, group, self._merges()[k], digits)
            slices.append(table.index_select(0, digits))  # (U, r_in, N_g, r_out)
            gathers.append((slices[-1], table, digits))
        traced = _traced()
        with contextlib.nullcontext() if traced else _regathered_in_backward(gathers):
            rows = self.compiled()(*slices).reshape(ids.shape[0], self.embedding_dim)
        return self._pad(rows, ids)

    def _pair_table(self, cores: list[Tensor], group: tuple[int, ...],
                    merge: tncomp.CompiledNetwork, digits: Tensor) -> tuple[Tensor, Tensor]:
        """The merged rows of a pair of cores that the pair ``digits`` (U,) use, and the
        digits into them: the used pairs only (:func:`_merge_pair_rows`) when grouping them
        does fewer multiply-adds than merging the whole (m1*m2)-row table, else the table."""
        first, second = cores[group[0]], cores[group[1]]
        r0, m1, n1, _ = first.shape
        _, m2, n2, r2 = second.shape
        pairs, inverse = torch.unique(digits, return_inverse=True)  # (P,), (U,)
        a, b = torch.div(pairs, m2, rounding_mode="floor"), pairs % m2
        by_b = r0 * n1 <= n2 * r2  # which digit _merge_pair_rows groups by
        grouped = b if by_b else a
        groups = m2 if by_b else m1
        if groups * int(torch.bincount(grouped).max()) < m1 * m2:
            return _merge_pair_rows(first, second, a, b), inverse
        merged = merge(first, second)  # (m1, m2, r0, n1, n2, r2)
        return merged.reshape(m1 * m2, r0, n1 * n2, r2), digits

    def to_dense(self) -> Tensor:
        """The table as ``nn.Embedding.weight``: (num_embeddings, embedding_dim)."""
        return self._unpadded(ttm_to_matrix(self.gated_cores()))

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, ranks: Ranks = 16,
                       row_modes: Sequence[int] | None = None,
                       col_modes: Sequence[int] | None = None, tau: float = DEFAULT_TAU,
                       d: int = 3, merge_pairs: bool = True, **options) -> TTEmbedding:
        """A TT embedding initialised by TT-matrix SVD of a trained table (rows zero-padded)."""
        return super().from_embedding(embedding, ranks, row_modes, col_modes, tau, d,
                                      merge_pairs=merge_pairs, **options)


def embedding_class(format: Format | str) -> type[GatedEmbedding]:
    """The table class of a table format (TTEmbedding for ``"ttm"``; GatedEmbedding else)."""
    name = get_format(format).name
    return TTEmbedding if name == TTEmbedding.fixed_format else GatedEmbedding


def table_format(format: Format | str, what: str = "format") -> str:
    """The registered format a table of the layer kind ``format`` is held in (TT: ``"ttm"``),
    else a :class:`ConfigError` naming the formats that hold tables."""
    held = get_format(format).table_format
    if held is None:
        raise ConfigError(f"{what}={get_format(format).name!r} holds no embedding tables; "
                          f"choose one of {', '.join(table_formats())}.")
    return held


def gated_embedding(num_embeddings: int, embedding_dim: int, format: Format | str,
                    **options) -> GatedEmbedding:
    """A table for the layer kind ``format`` (held in :func:`table_format`, by the class of
    :func:`embedding_class`), randomly initialised; ``options``: the table's other arguments
    (ranks, row_modes, col_modes, padding_idx, tau, d, dtype, device)."""
    held = table_format(format)
    return embedding_class(held)(num_embeddings, embedding_dim, format=held, **options)
