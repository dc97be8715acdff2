"""A network declared as an einsum: try a structure without writing a format class.

``layout_from_eq("b i j, i a, a j k -> b k", bonds="a", sizes={"i": 4, "j": 8, "k": 16},
ranks=8)`` reads: x carries ``(b, i, j)``, two cores carry ``(i, a)`` and ``(a, j, k)``, y
carries ``(b, k)``, and ``a`` is a bond (a rank gate). Indices are single letters (spaces are
optional); the first index of x and of y is the batch. A feature index may sit on several cores
(a hyperedge); a bond is an index only cores carry.

:class:`Declared` is the format such a layer records (``"einsum"``): it has no constructor from
modes (the layout is the declaration), no decomposition and no rounding, and it exists so a
checkpoint record rebuilds the layer from its layout.
"""

from __future__ import annotations

import operator
import re
from collections import Counter
from collections.abc import Mapping, Sequence

from comera.errors import ConfigError
from comera.formats.layout import Layout
from comera.formats.registry import Format, Ranks
from comera.numbers import is_int

__all__ = ["Declared", "layout_from_eq"]

_TERM = re.compile(r"^[A-Za-z]*$")


def _terms(eq: object) -> tuple[list[str], str]:
    if not isinstance(eq, str):
        raise ConfigError(f"eq={eq!r}; give a string such as 'b i j, i a, a j k -> b k'.")
    lhs, arrow, rhs = eq.partition("->")
    if not arrow or "->" in rhs:
        raise ConfigError(f"eq {eq!r} needs one '->' and the output after it, e.g. "
                          "'b i j, i a, a j k -> b k'.")
    written = [t.strip() for t in (*lhs.split(","), rhs)]
    terms = [t.replace(" ", "") for t in written]
    for shown, term in zip(written, terms, strict=True):
        if not _TERM.match(term):
            raise ConfigError(f"eq {eq!r} has the term {shown!r}; indices are single letters "
                              "(no digits, '...' or other signs), e.g. 'b i j, i a -> b a'.")
        repeated = [i for i, n in Counter(term).items() if n > 1]
        if repeated:
            raise ConfigError(f"eq {eq!r}: index {repeated[0]!r} appears twice in {shown!r}; "
                              "each tensor carries an index once (no diagonals or traces).")
    if len(terms) < 3:
        raise ConfigError(f"eq {eq!r} has no core: write x first, then one or more cores, "
                          "e.g. 'b i, i k -> b k'.")
    return terms[:-1], terms[-1]


def _bond_names(bonds: object, eq: str) -> tuple[str, ...]:
    if isinstance(bonds, str):
        names = [c for c in bonds if c not in " ,"]
    elif isinstance(bonds, Sequence) and all(isinstance(b, str) for b in bonds):
        names = list(bonds)
    else:
        raise ConfigError(f"bonds={bonds!r}; give the bond letters as a string ('a' or 'a c') "
                          "or a list of letters.")
    for name in names:
        if len(name) != 1 or not name.isalpha():
            raise ConfigError(f"bonds {bonds!r} holds {name!r}; a bond is one index letter of "
                              f"eq {eq!r}.")
    if len(set(names)) != len(names):
        raise ConfigError(f"bonds {bonds!r} names an index twice.")
    return tuple(names)


def _size(name: str | None, value: object, what: str) -> int:
    if not is_int(value):
        where = what if name is None else f"{what}[{name!r}]"
        raise ConfigError(f"{where}={value!r}; give an int >= 1.")
    return operator.index(value)


def layout_from_eq(eq: str, bonds: str | Sequence[str], sizes: Mapping[str, int],
                   ranks: int | Mapping[str, int] | None = None) -> Layout:
    """The :class:`Layout` an einsum declares (see the module).

    ``sizes`` gives every index but the batch and the bonds (a bond given here is allowed);
    ``ranks`` gives the bonds: one int for all, a mapping per bond, or None (every bond then in
    ``sizes``). An int ``ranks`` is capped per bond, and a bond's size in ``sizes`` or a
    ``ranks`` mapping must be at most that cap (a :class:`ConfigError` otherwise): for a bond
    joining two cores, :meth:`Layout.bond_caps` (the smaller product of either core's other
    indices: a larger bond only repeats what that core holds); for any bond, the dense
    weight's number of entries. So no bond reaches the allocator larger than the weight.
    """
    terms, out = _terms(eq)
    x, cores = terms[0], terms[1:]
    if not x:
        raise ConfigError(f"eq {eq!r}: x (the first operand) has no index; its first index is "
                          "the batch, e.g. 'b i j, ... -> b k'.")
    batch = x[0]
    if not out or out[0] != batch:
        raise ConfigError(f"eq {eq!r}: the output must start with the batch index {batch!r} "
                          f"(x's first index), got {out!r}; write '-> {batch}...'.")
    inputs, outputs = tuple(x[1:]), tuple(out[1:])
    for k, core in enumerate(cores):
        if not core:
            raise ConfigError(f"eq {eq!r}: core {k + 1} (operand {k + 2}) has no index; every "
                              "core carries at least one index.")
        if batch in core:
            raise ConfigError(f"eq {eq!r}: core {k + 1} ({core!r}) carries the batch index "
                              f"{batch!r}; the batch is on x and y only.")
    on_cores = Counter(i for core in cores for i in core)
    both = sorted(set(inputs) & set(outputs))
    if both:
        raise ConfigError(f"eq {eq!r}: index {both[0]!r} is on x and on y; a feature index "
                          "is an input (on x) or an output (on y), joined through the cores.")
    for index in (*inputs, *outputs):
        if index not in on_cores:
            side = "x" if index in inputs else "y"
            raise ConfigError(f"eq {eq!r}: index {index!r} of {side} is on no core, so the "
                              "weight never reaches it; put it on the core that reads or "
                              "makes it.")
    features = {*inputs, *outputs}
    lonely = sorted(i for i, n in on_cores.items() if n == 1 and i not in features)
    if lonely:
        raise ConfigError(f"eq {eq!r}: index {lonely[0]!r} is on one core only and nowhere "
                          "else, so it is summed inside that core; join it to another core "
                          "or drop it.")
    bond_names = _bond_names(bonds, eq)
    for bond in bond_names:
        if bond not in on_cores:
            raise ConfigError(f"eq {eq!r}: bond {bond!r} is on no core; bonds are indices the "
                              f"cores carry: {''.join(sorted(set(on_cores) - features))!r}.")
        if bond in features or bond == batch:
            raise ConfigError(f"eq {eq!r}: bond {bond!r} is on x or y; a bond is summed inside "
                              "the weight (an index only cores carry).")
    resolved, capped = _resolve_sizes(eq, batch, set(on_cores) | features, bond_names, sizes,
                                      ranks)
    order = dict.fromkeys([*inputs, *outputs, *(i for core in cores for i in core)])
    layout = Layout(inputs, outputs, tuple(tuple(core) for core in cores),
                    tuple((i, resolved[i]) for i in order), bond_names)
    dense = layout.in_features * layout.out_features  # no bond is useful beyond the weight
    caps = [dense if cap is None else min(cap, dense)
            for cap in layout.bond_caps(layout.bond_sizes)]
    for bond, cap in zip(bond_names, caps, strict=True):
        if bond not in capped and layout.size(bond) > cap:
            given = "sizes" if bond in sizes else "ranks"
            raise ConfigError(f"{given}[{bond!r}]={layout.size(bond)} is above {cap}, the largest "
                              f"size bond {bond!r} can use in eq {eq!r} (a larger bond only "
                              f"adds zero directions); give at most {cap}, or an int ranks, "
                              "which is capped per bond.")
    return layout.resized({b: min(layout.size(b), cap) for b, cap in
                           zip(bond_names, caps, strict=True) if b in capped})


def _resolve_sizes(eq: str, batch: str, indices: set[str], bonds: tuple[str, ...],
                   sizes: Mapping[str, int], ranks: Ranks | Mapping[str, int] | None,
                   ) -> tuple[dict[str, int], set[str]]:
    """Every index's size, and the bonds that took the int ``ranks`` (which are capped)."""
    if not isinstance(sizes, Mapping):
        raise ConfigError(f"sizes={sizes!r}; give a mapping from index letter to size, e.g. "
                          "{'i': 4, 'j': 8}.")
    if batch in sizes:
        raise ConfigError(f"sizes gives the batch index {batch!r}; the batch size is the "
                          "input's, leave it out.")
    unknown = sorted(set(sizes) - indices)
    if unknown:
        raise ConfigError(f"sizes names {unknown}, which eq {eq!r} does not use; its indices "
                          f"are {''.join(sorted(indices))!r}.")
    fixed = {i: _size(i, v, "sizes") for i, v in sizes.items()}
    missing = sorted(indices - set(fixed) - set(bonds))
    if missing:
        raise ConfigError(f"sizes has no entry for {missing}; give every index but the batch "
                          "and the bonds a size.")
    per_bond: dict[str, int] = {}
    uniform: int | None = None
    if isinstance(ranks, Mapping):
        unknown = sorted(set(ranks) - set(bonds))
        if unknown:
            raise ConfigError(f"ranks names {unknown}, which are not bonds; the bonds are "
                              f"{list(bonds)}.")
        per_bond = {b: _size(b, v, "ranks") for b, v in ranks.items()}
    elif ranks is not None:
        uniform = _size(None, ranks, "ranks")
    for bond in bonds:
        if bond in per_bond and bond in fixed and per_bond[bond] != fixed[bond]:
            raise ConfigError(f"bond {bond!r} has size {fixed[bond]} in sizes and "
                              f"{per_bond[bond]} in ranks; give it once.")
        if bond not in per_bond and bond not in fixed and uniform is None:
            raise ConfigError(f"bond {bond!r} has no size; pass ranks (an int for every bond, "
                              f"or {{{bond!r}: r}}) or give it in sizes.")
    resolved = dict(fixed)
    for bond in bonds:
        if bond in per_bond:
            resolved[bond] = per_bond[bond]
        elif bond not in fixed:
            resolved[bond] = uniform
    return resolved, {b for b in bonds if b not in per_bond and b not in fixed}


class Declared(Format):
    """The format of a layer declared by an einsum (:func:`layout_from_eq`)."""

    name, title = "einsum", "declared einsum"
    from_modes = False

    def layout(self, in_modes, out_modes, ranks: Ranks) -> Layout:
        raise ConfigError("format='einsum' has no layout from modes: declare the network with "
                          "GatedLinear.from_eq(eq, bonds, sizes, ranks), or build it with "
                          "comera.formats.einsum.layout_from_eq and GatedLinear.from_layout.")
