"""Einsum equations read as ``torch.einsum`` reads them, turned into networks with distinct indices.

``parse_eq(eq, *shapes)`` gives an :class:`Einsum`: one label per operand axis, with

- ``...`` expanded into fresh labels ``.0``, ``.1``, ... (right-aligned across operands, as in
  NumPy broadcasting; an output without ``->`` starts with them, then the letters that appear
  once, sorted, which is einsum's rule);
- size-1 broadcasting (of ``...`` axes and of letters, as ``torch.einsum`` does): an axis of size
  1 whose label has another size elsewhere gets a fresh label of its own (``j~0``: ``j`` on
  operand 0), summed away within its operand, which is what broadcasting computes;
- repeated labels within one operand (diagonals and traces such as ``aab,bcc->ac``) kept in
  ``terms``, with the ``torch.diagonal`` steps that turn each operand into a strided view with
  distinct labels (``diagonals``). The planner only ever sees :meth:`Einsum.network`, whose
  operands are those views.

Torch-free: the views are taken by the caller (:func:`tncomp.contract`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from tncomp.compiler.ir import Dim, Network, Role, Size, make_network
from tncomp.errors import IRError

ELLIPSIS = "..."
_TERM = re.compile(r"^[A-Za-z]*(\.\.\.)?[A-Za-z]*$")


@dataclass(frozen=True, slots=True)
class Einsum:
    """A parsed equation: every operand axis labelled, the output, and every label's size.

    ``terms[k]`` labels the axes of operand ``k`` in order (a label may repeat: a diagonal);
    ``diagonals[k]`` lists the ``(dim1, dim2)`` of each ``torch.diagonal`` call that turns
    operand ``k`` into a view with distinct labels ``planned_terms[k]`` (each call removes both
    axes and appends their diagonal last, as torch does).
    """

    eq: str
    names: tuple[str, ...]
    terms: tuple[tuple[str, ...], ...]
    output: tuple[str, ...]
    sizes: tuple[tuple[str, Size], ...]
    diagonals: tuple[tuple[tuple[int, int], ...], ...]
    planned_terms: tuple[tuple[str, ...], ...]

    @property
    def has_diagonals(self) -> bool:
        return any(self.diagonals)

    def network(self) -> Network:
        """The network over the diagonal views (distinct labels on every tensor)."""
        counts = Counter(i for t in (*self.planned_terms, self.output) for i in set(t))
        hyper = {i for i, c in counts.items() if c > 2}
        used = {i for t in self.planned_terms for i in t}
        operands = [(n, list(t), Role.INPUT)
                    for n, t in zip(self.names, self.planned_terms, strict=True)]
        sizes = {i: s for i, s in self.sizes if i in used}
        return make_network(operands, ("out", list(self.output)), sizes, hyper)


def _split(eq: str) -> tuple[list[str], str | None]:
    text = eq.replace(" ", "")
    lhs, arrow, rhs = text.partition("->")
    if "->" in rhs:
        raise IRError(f"eq {eq!r} has more than one '->'; write INPUTS->OUTPUT once.")
    terms = lhs.split(",")
    for term in (*terms, rhs):
        if not _TERM.match(term):
            raise IRError(
                f"eq {eq!r} has term {term!r}; terms are letters only, plus at most one '...', "
                "e.g. 'bi,ij->bj' or '...ij,...jk->...ik'."
            )
    return terms, (rhs if arrow else None)


def _as_size(value: Size | str, what: str, dims: dict[str, Dim]) -> Size:
    if isinstance(value, str):
        value = dims.get(value, Dim(value))
    if isinstance(value, bool) or not isinstance(value, int | Dim):
        raise IRError(f"{what} is {value!r}; pass an int, a tncomp.Dim or a symbol name.")
    if isinstance(value, Dim):
        known = dims.setdefault(value.name, value)
        if known != value:
            raise IRError(
                f"symbol {value.name!r} is declared with bounds [{known.min}, {known.max}] and "
                f"[{value.min}, {value.max}]; declare one Dim and reuse it."
            )
    return value


def _labels(name: str, term: str, shape: tuple, n_ellipsis: int) -> list[str]:
    """The labels of one operand's axes (``...`` expanded; right-aligned positions)."""
    letters = term.replace(ELLIPSIS, "")
    if ELLIPSIS not in term:
        if len(shape) != len(term):
            raise IRError(f"operand {name!r} ({term!r}) has {len(term)} indices but shape "
                          f"{shape} has {len(shape)} axes.")
        return list(term)
    extra = len(shape) - len(letters)
    if extra < 0:
        raise IRError(f"operand {name!r} ({term!r}) names {len(letters)} axes besides '...' "
                      f"but shape {shape} has only {len(shape)}.")
    head, _, tail = term.partition(ELLIPSIS)
    start = n_ellipsis - extra
    return [*head, *(f".{start + k}" for k in range(extra)), *tail]


def parse_eq(eq: str, *shapes: Sequence[Size | str],
             names: Sequence[str] | None = None) -> Einsum:
    """Read ``eq`` against one shape per operand, as ``torch.einsum`` would (see the module)."""
    if not isinstance(eq, str):
        raise IRError(f"eq must be a str such as 'bi,ij->bj', got {eq!r} "
                      f"({type(eq).__name__}).")
    terms, rhs = _split(eq)
    if len(terms) != len(shapes):
        raise IRError(f"eq {eq!r} has {len(terms)} operands but {len(shapes)} shapes were given.")
    names = tuple(names) if names is not None else tuple(f"T{k}" for k in range(len(terms)))
    if len(names) != len(terms):
        raise IRError(f"names has {len(names)} entries for {len(terms)} operands.")
    checked = []
    for name, term, shape in zip(names, terms, shapes, strict=True):
        if isinstance(shape, str | bytes) or not isinstance(shape, Sequence):
            n = len(term.replace(ELLIPSIS, ""))
            raise IRError(f"shape of operand {name!r} ({term!r}) is {shape!r}; give a sequence "
                          f"of {n} sizes such as {tuple(range(2, n + 2))}.")
        checked.append(tuple(shape))
    n_ellipsis = max((len(s) - len(t.replace(ELLIPSIS, "")) for t, s in
                      zip(terms, checked, strict=True) if ELLIPSIS in t), default=0)
    labelled = [_labels(n, t, s, n_ellipsis)
                for n, t, s in zip(names, terms, checked, strict=True)]
    output = _output(eq, terms, rhs, labelled, n_ellipsis)

    dims: dict[str, Dim] = {}
    raw: list[list[Size]] = [
        [_as_size(v, f"size of index {i!r} of {n!r}", dims) for i, v in zip(ls, s, strict=True)]
        for n, ls, s in zip(names, labelled, checked, strict=True)]
    sizes = _broadcast(eq, names, labelled, raw)
    for labels in labelled:
        for index in labels:
            sizes.setdefault(index, 1)
    missing = [i for i in output if i not in sizes]
    if missing:
        raise IRError(f"output index {missing[0]!r} of eq {eq!r} is dangling: no operand "
                      "carries it; remove it from the output or add it to an operand.")
    diagonals, planned = zip(*(_diagonal_steps(ls) for ls in labelled), strict=True)
    return Einsum(eq, names, tuple(tuple(ls) for ls in labelled), tuple(output),
                  tuple(sizes.items()), tuple(diagonals), tuple(planned))


def _output(eq: str, terms: list[str], rhs: str | None, labelled: list[list[str]],
            n_ellipsis: int) -> list[str]:
    ellipsis = [f".{p}" for p in range(n_ellipsis)]
    if rhs is None:  # einsum's rule: '...' first, then the letters that appear once, sorted
        counts = Counter("".join(t.replace(ELLIPSIS, "") for t in terms))
        return ellipsis + sorted(c for c, k in counts.items() if k == 1)
    head, _, tail = rhs.partition(ELLIPSIS)
    output = [*head, *(ellipsis if ELLIPSIS in rhs else ()), *tail]
    repeated = [i for i, c in Counter(output).items() if c > 1]
    if repeated:
        raise IRError(f"output index {repeated[0]!r} appears twice in eq {eq!r}; an output "
                      "index appears once.")
    return output


def _broadcast(eq: str, names: Sequence[str], labelled: list[list[str]],
               raw: list[list[Size]]) -> dict[str, Size]:
    """Every label's size; size-1 axes that broadcast against another size are relabelled."""
    seen: dict[str, tuple[Size, str]] = {}  # label -> (size other than 1, operand name)
    for name, labels, sizes in zip(names, labelled, raw, strict=True):
        own: dict[str, Size] = {}
        for index, size in zip(labels, sizes, strict=True):
            if own.setdefault(index, size) != size:
                raise IRError(
                    f"index {index!r} repeats on operand {name!r} (a diagonal) with sizes "
                    f"{own[index]} and {size}; a diagonal's axes have one size."
                )
        for index, size in own.items():
            if size == 1:
                continue
            first = seen.setdefault(index, (size, name))
            if first[0] != size:
                label = "an axis of '...'" if index.startswith(".") else f"index {index!r}"
                raise IRError(
                    f"{label} has size {first[0]} on one operand and {size} on {name!r} "
                    f"({first[0]} on {first[1]!r}) in eq {eq!r}; a shared index needs one size "
                    "(or 1, which broadcasts)."
                )
    sizes: dict[str, Size] = {i: s for i, (s, _) in seen.items()}
    for k, (labels, shape) in enumerate(zip(labelled, raw, strict=True)):
        for axis, (index, size) in enumerate(zip(labels, shape, strict=True)):
            if size == 1 and index in seen:  # broadcast: its own label, summed in place
                labels[axis] = f"{index}~{k}"
                sizes[labels[axis]] = 1
    return sizes


def _diagonal_steps(labels: list[str]) -> tuple[tuple[tuple[int, int], ...], tuple[str, ...]]:
    """The ``torch.diagonal(dim1, dim2)`` calls that leave distinct labels, and those labels."""
    labels, steps = list(labels), []
    while True:
        counts = Counter(labels)
        index = next((i for i in labels if counts[i] > 1), None)
        if index is None:
            return tuple(steps), tuple(labels)
        first = labels.index(index)
        second = labels.index(index, first + 1)
        steps.append((first, second))
        labels = [i for k, i in enumerate(labels) if k not in (first, second)] + [index]
