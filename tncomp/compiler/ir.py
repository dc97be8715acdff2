"""The IR: a frozen tensor network of named indices with integer or symbolic sizes.

A :class:`Network` is a set of operand tensors (inputs and parameters) and one output tensor,
joined by named indices. Sizes are ints or :class:`Dim` symbols (sympy symbols with bounds) so
costs can be computed as formulas in, say, the batch size ``B``. Networks are validated on
construction by :func:`check_network`; a network that exists is well formed.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import sympy

from tncomp.errors import IRError, SizeError


@dataclass(frozen=True, slots=True)
class Dim:
    """A symbolic size such as the batch ``B``, with inclusive bounds (``max=None``: unbounded)."""

    name: str
    min: int = 1
    max: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise IRError(f"Dim name is {self.name!r} ({type(self.name).__name__}); name a "
                          "symbol with a str such as Dim('B').")
        for bound in ("min", "max"):
            value = getattr(self, bound)
            if (isinstance(value, bool) or not isinstance(value, int)) and not (
                    bound == "max" and value is None):
                allowed = "an int" if bound == "min" else "an int or None (unbounded)"
                raise IRError(f"Dim {self.name!r} has {bound}={value!r} "
                              f"({type(value).__name__}); give {allowed}, e.g. "
                              f"Dim({self.name!r}, min=1, max=4096).")
        if not self.name.isidentifier():
            raise IRError(f"Dim name {self.name!r} is not an identifier; use e.g. Dim('B').")
        if self.min < 1:
            raise IRError(f"Dim {self.name!r} has min={self.min}; sizes are at least 1.")
        if self.max is not None and self.max < self.min:
            raise IRError(f"Dim {self.name!r} has max={self.max} < min={self.min}.")

    @property
    def symbol(self) -> sympy.Symbol:
        """The sympy symbol used in cost formulas (positive integer)."""
        return sympy.Symbol(self.name, positive=True, integer=True)

    def check(self, value: int, where: str) -> int:
        """Return ``value`` if it lies in the bounds, else raise a :class:`SizeError`."""
        if value < self.min or (self.max is not None and value > self.max):
            hi = "inf" if self.max is None else self.max
            raise SizeError(
                f"{where}: {self.name}={value} is outside its bounds [{self.min}, {hi}]; "
                f"pass a size in range or widen Dim({self.name!r}, min=..., max=...)."
            )
        return value

    def __str__(self) -> str:
        return self.name


Size = int | Dim


class Role(enum.Enum):
    """What a tensor of the network is: data flowing in, a trained parameter, or the result."""

    INPUT = "input"
    PARAMETER = "parameter"
    OUTPUT = "output"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a network: its name, its indices in axis order, and its role."""

    name: str
    indices: tuple[str, ...]
    role: Role


@dataclass(frozen=True, slots=True)
class Network:
    """A tensor network: operands (call order), the output, and the size of every index.

    ``hyper`` names the indices allowed on more than two tensors (counting the output), such as
    a batch index shared by gathered embedding slices.
    """

    operands: tuple[TensorSpec, ...]
    output: TensorSpec
    sizes: tuple[tuple[str, Size], ...]
    hyper: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        check_network(self)

    @property
    def size_dict(self) -> dict[str, Size]:
        """``{index: size}`` for every index (an int, or a :class:`Dim` where symbolic)."""
        return dict(self.sizes)

    @property
    def dims(self) -> tuple[Dim, ...]:
        """The symbolic sizes of the network, in order of first appearance."""
        seen: dict[str, Dim] = {}
        for _, size in self.sizes:
            if isinstance(size, Dim):
                seen.setdefault(size.name, size)
        return tuple(seen.values())

    def shape(self, tensor: TensorSpec) -> tuple[Size, ...]:
        """The shape of ``tensor`` (a tensor of this network): the size of each of its indices."""
        sizes = self.size_dict
        return tuple(sizes[i] for i in tensor.indices)

    @property
    def eq(self) -> str:
        """An einsum-style equation over the index names, e.g. ``'b,i1|i1,r1->b'``."""
        ins = ",".join(" ".join(t.indices) for t in self.operands)
        return f"{ins} -> {' '.join(self.output.indices)}"

    def __str__(self) -> str:
        lines = [f"Network with {len(self.operands)} operands -> {self.output.name}"]
        width = max(len(t.name) for t in (*self.operands, self.output))
        for t in (*self.operands, self.output):
            shape = ", ".join(str(s) for s in self.shape(t))
            indices = ", ".join(t.indices)
            lines.append(f"  {t.name:<{width}}  {t.role.value:<9}  ({indices})  [{shape}]")
        return "\n".join(lines)


def check_network(net: Network) -> None:
    """Raise :class:`IRError` naming the first problem of a malformed network."""
    if not net.operands:
        raise IRError("empty network: a network needs at least one operand tensor.")
    names = [t.name for t in (*net.operands, net.output)]
    dup = [n for n, c in Counter(names).items() if c > 1]
    if dup:
        raise IRError(f"tensor name {dup[0]!r} is used twice; give every tensor its own name.")
    sizes: dict[str, Size] = {}
    for index, size in net.sizes:
        if index in sizes:
            raise IRError(f"index {index!r} is given two sizes; give each index one size.")
        if isinstance(size, bool) or not isinstance(size, int | Dim):
            raise IRError(f"index {index!r} has size {size!r}; sizes are ints >= 1 or tncomp.Dim.")
        if isinstance(size, int) and size < 1:
            raise IRError(f"index {index!r} has size {size}; sizes must be >= 1.")
        sizes[index] = size
    operand_indices = {i for t in net.operands for i in t.indices}
    for index in net.output.indices:
        if index not in operand_indices:
            raise IRError(
                f"output index {index!r} is dangling: no operand carries it; "
                "remove it from the output or add it to an operand."
            )
    used: Counter[str] = Counter()
    for t in (*net.operands, net.output):
        for index in t.indices:
            if not isinstance(index, str) or not index:
                raise IRError(f"tensor {t.name!r} has index {index!r}; indices are non-empty str.")
            if index not in sizes:
                raise IRError(f"index {index!r} of tensor {t.name!r} has no size; add it to sizes.")
        repeated = [i for i, c in Counter(t.indices).items() if c > 1]
        if repeated:
            raise IRError(
                f"index {repeated[0]!r} appears twice on tensor {t.name!r} (a diagonal or "
                "trace); tncomp does not take repeated indices within one tensor: take "
                "torch.diagonal first."
            )
        used.update(t.indices)
    unused = sorted(set(sizes) - set(used))
    if unused:
        raise IRError(f"index {unused[0]!r} has a size but no tensor carries it; remove it.")
    for index, count in used.items():
        if count > 2 and index not in net.hyper:
            holders = [t.name for t in (*net.operands, net.output) if index in t.indices]
            raise IRError(
                f"index {index!r} appears on {count} tensors ({', '.join(holders)}); an index "
                f"joins at most two tensors unless declared a hyperedge: pass "
                f"hyper={{{index!r}}}."
            )
    bad_hyper = sorted(net.hyper - set(sizes))
    if bad_hyper:
        raise IRError(f"hyperedge {bad_hyper[0]!r} is not an index of the network.")


def make_network(
    operands: Sequence[tuple[str, Sequence[str], Role]],
    output: tuple[str, Sequence[str]],
    sizes: Mapping[str, Size],
    hyper: Iterable[str] = (),
) -> Network:
    """Build a :class:`Network` from plain tuples: ``(name, indices, role)`` per operand."""
    return Network(
        operands=tuple(TensorSpec(n, tuple(ix), role) for n, ix, role in operands),
        output=TensorSpec(output[0], tuple(output[1]), Role.OUTPUT),
        sizes=tuple(sizes.items()),
        hyper=frozenset(hyper),
    )


def structural_key(net: Network) -> tuple:
    """A key equal for networks that differ only in index and tensor names.

    Index labels are canonicalised by order of first appearance (operands, then output), so
    relabelled but identical networks share cache entries. Symbol names are left out; bounds stay.
    """
    canon: dict[str, int] = {}
    for t in (*net.operands, net.output):
        for index in t.indices:
            canon.setdefault(index, len(canon))
    sizes = net.size_dict

    def size_part(s: Size) -> tuple:
        return ("int", s) if isinstance(s, int) else ("dim", s.min, s.max)

    return (
        tuple((t.role.value, tuple(canon[i] for i in t.indices)) for t in net.operands),
        tuple(canon[i] for i in net.output.indices),
        tuple(size_part(sizes[i]) for i in sorted(canon, key=canon.__getitem__)),
        tuple(sorted(canon[i] for i in net.hyper)),
    )


def bind_sizes(net: Network, shapes: Sequence[Sequence[int]]) -> dict[str, int]:
    """Match concrete operand shapes against the network; return every index's integer size.

    Raises :class:`SizeError` naming the tensor, the axis, what was expected and what was got.
    """
    if len(shapes) != len(net.operands):
        names = ", ".join(t.name for t in net.operands)
        raise SizeError(f"expected {len(net.operands)} tensors ({names}), got {len(shapes)}.")
    declared = net.size_dict
    bound: dict[str, int] = {}
    symbols: dict[str, int] = {}
    for spec, shape in zip(net.operands, shapes, strict=True):
        shape = tuple(shape)
        if len(shape) != len(spec.indices):
            raise SizeError(
                f"tensor {spec.name!r} should have {len(spec.indices)} axes "
                f"({', '.join(spec.indices)}), got shape {shape}."
            )
        for axis, (index, value) in enumerate(zip(spec.indices, shape, strict=True)):
            size = declared[index]
            where = f"tensor {spec.name!r} axis {axis} ({index})"
            if isinstance(size, int) and value != size:
                raise SizeError(f"{where}: expected size {size}, got {value} (shape {shape}).")
            if isinstance(size, Dim):
                size.check(value, where)
                if symbols.setdefault(size.name, value) != value:
                    raise SizeError(
                        f"{where}: {size.name}={value} disagrees with {size.name}="
                        f"{symbols[size.name]} bound on another axis."
                    )
            if bound.setdefault(index, value) != value:
                raise SizeError(
                    f"{where}: size {value} disagrees with {bound[index]} bound earlier for "
                    f"index {index!r}; every tensor must agree on a shared index."
                )
    return bound


def bind_dims(net: Network, value: int) -> dict[str, int]:
    """Every index's integer size, each symbolic size set to ``value`` (the one home of "bind
    the batch": regimes, cost curves, pictures and reports all use it)."""
    return {index: (value if isinstance(size, Dim) else size) for index, size in net.sizes}
