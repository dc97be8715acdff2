"""A format's layout: the indices each core carries, their sizes, and which indices are bonds.

A gated layer computes ``y = x @ W`` where W is a tensor network of cores. The layout is that
network written once, as index names: ``x`` carries ``inputs`` (after the batch), ``y`` carries
``outputs``, core k carries ``cores[k]`` (in axis order). ``bonds`` are the indices that carry a
rank gate, in gate order; any index of the network can be one (a chain's link, a Tucker factor's
rank, a CP hyperedge, a ring's closing link). Everything comera does with ranks (gates, sizes,
regularisers, pruning, truncation, checkpoints) reads the layout, never a format's class.

Gate k folds into the first core that carries bond k (:meth:`Layout.carriers`), along that axis.
"""

from __future__ import annotations

import math
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

import tncomp
from comera.errors import ConfigError
from comera.numbers import is_int


@dataclass(frozen=True)
class Layout:
    """One layer's network: ``y[b, *outputs] = sum x[b, *inputs] * core_1[...] * ... ``."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    cores: tuple[tuple[str, ...], ...]
    sizes: tuple[tuple[str, int], ...]
    bonds: tuple[str, ...]

    def __post_init__(self) -> None:
        known = dict(self.sizes)
        used = {*self.inputs, *self.outputs, *(i for core in self.cores for i in core)}
        missing = sorted(used - known.keys())
        if missing:
            raise ConfigError(f"indices {missing} have no size; give every index a size.")
        for name, size in self.sizes:
            if not is_int(size):
                raise ConfigError(f"index {name!r} has size {size!r}; sizes are ints >= 1.")
        for bond in self.bonds:
            if not any(bond in core for core in self.cores):
                raise ConfigError(f"bond {bond!r} is on no core; a bond is an index the cores "
                                  f"carry: one of {sorted({i for c in self.cores for i in c})}.")
            if bond in self.inputs or bond in self.outputs:
                raise ConfigError(f"bond {bond!r} is a feature index of x or y; a bond is "
                                  "summed inside the weight (an index only cores carry).")
        if len(set(self.bonds)) != len(self.bonds):
            raise ConfigError(f"bonds {self.bonds} name an index twice.")
        for k, core in enumerate(self.cores):
            if len(set(core)) != len(core):
                raise ConfigError(f"core {k} carries {core}: an index twice.")

    # -- sizes ----------------------------------------------------------------------------------
    def size(self, index: str) -> int:
        """The size of ``index``."""
        return dict(self.sizes)[index]

    @property
    def in_features(self) -> int:
        return math.prod(self.size(i) for i in self.inputs)

    @property
    def out_features(self) -> int:
        return math.prod(self.size(i) for i in self.outputs)

    @property
    def in_modes(self) -> tuple[int, ...]:
        return tuple(self.size(i) for i in self.inputs)

    @property
    def out_modes(self) -> tuple[int, ...]:
        return tuple(self.size(i) for i in self.outputs)

    @property
    def core_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(self.size(i) for i in core) for core in self.cores)

    @property
    def bond_sizes(self) -> tuple[int, ...]:
        """The stored size of each bond, in gate order."""
        return tuple(self.size(b) for b in self.bonds)

    @property
    def internal(self) -> tuple[str, ...]:
        """The indices summed inside W (on cores only, not on x or y): bonds and fixed links."""
        feature = {*self.inputs, *self.outputs}
        return tuple(dict.fromkeys(i for core in self.cores for i in core if i not in feature))

    def carriers(self, bond: str) -> tuple[tuple[int, int], ...]:
        """``(core, axis)`` of every core that carries ``bond``; the gate folds into the first."""
        return tuple((k, core.index(bond)) for k, core in enumerate(self.cores) if bond in core)

    def resized(self, bond_sizes: Mapping[str, int]) -> Layout:
        """The same layout with the bonds named in ``bond_sizes`` at those sizes."""
        sizes = tuple((name, int(bond_sizes.get(name, size))) for name, size in self.sizes)
        return Layout(self.inputs, self.outputs, self.cores, sizes, self.bonds)

    def parameters_at(self, bond_sizes: Sequence[int]) -> int:
        """Parameters of the cores with bond k at ``bond_sizes[k]`` (other indices as stored)."""
        at = dict(self.sizes) | dict(zip(self.bonds, bond_sizes, strict=True))
        return sum(math.prod(at[i] for i in core) for core in self.cores)

    @property
    def is_chain(self) -> bool:
        """True for a chain (TT, TT-matrix): core k carries bond k-1 first and bond k last,
        the two ends are size-1 indices on the end cores only. Chain layers state their ranks
        with the ends, ``(1, r_1, ..., r_{n-1}, 1)``."""
        n = len(self.cores)
        if n < 1 or len(self.bonds) != n - 1:
            return False
        ends = (self.cores[0][0], self.cores[-1][-1])
        if any(self.size(e) != 1 or e in self.bonds for e in ends):
            return False
        if any(e in core for e in ends[:1] for core in self.cores[1:]) or any(
                ends[1] in core for core in self.cores[:-1]):
            return False
        return all(self.cores[k][-1] == bond and self.cores[k + 1][0] == bond
                   and self.carriers(bond) == ((k, len(self.cores[k]) - 1), (k + 1, 0))
                   for k, bond in enumerate(self.bonds))

    def core_sizes_with(self, values: Sequence) -> list:
        """Each core's size with bond k counted as ``values[k]``: the one size formula.

        ``values`` may be ints (the parameter count, as :meth:`parameters_at`), gate l1 norms
        (the differentiable soft size) or tensors of live-gate counts (a size kept on the
        device). Each term is the product of the core's other index sizes (an int) times the
        bond values in axis order; callers sum the terms in core order."""
        at = dict(zip(self.bonds, values, strict=True))
        terms = []
        for core in self.cores:
            term = math.prod(self.size(i) for i in core if i not in at)
            for i in core:
                if i in at:
                    term = term * at[i]
            terms.append(term)
        return terms

    def slice_costs(self, bond_sizes: Sequence[int]) -> tuple[int, ...]:
        """Per bond, the parameters one slice of it costs at ``bond_sizes``: the sum over the
        cores that carry it of the product of that core's other indices."""
        at = dict(self.sizes) | dict(zip(self.bonds, bond_sizes, strict=True))
        return tuple(sum(math.prod(at[i] for i in self.cores[k] if i != bond)
                         for k, _ in self.carriers(bond)) for bond in self.bonds)

    def bond_caps(self, bond_sizes: Sequence[int]) -> tuple[int | None, ...]:
        """Per bond carried by exactly two cores, the most it can carry at ``bond_sizes``: the
        smaller of the two cores' other indices' products (a QR of either core reaches it
        exactly); None for the other bonds (a hyperedge, a bond on one core)."""
        at = dict(self.sizes) | dict(zip(self.bonds, bond_sizes, strict=True))
        caps: list[int | None] = []
        for bond in self.bonds:
            carriers = self.carriers(bond)
            caps.append(min(math.prod(at[i] for i in self.cores[k] if i != bond)
                            for k, _ in carriers) if len(carriers) == 2 else None)
        return tuple(caps)

    def core_roles(self) -> tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]:
        """Per core, its axes as ``(block, fan_in, fan_out)``: the core read as one layer of the
        flow from x to y.

        The cores are applied one at a time, each time the first (in layout order) that touches
        what has been computed so far. A core's fan-in axes are the indices it sums away
        (present already and needed by no later core nor by y, or carried by it alone); its
        fan-out axes bring in indices a later core or y reads; block axes (present before and
        needed after: BTT's blocks, a CP hyperedge) are in neither."""
        present = set(self.inputs)
        todo = list(range(len(self.cores)))
        roles: dict[int, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}
        while todo:
            k = next((k for k in todo if present.intersection(self.cores[k])), todo[0])
            todo.remove(k)
            later = {i for j in todo for i in self.cores[j]} | set(self.outputs)
            core = self.cores[k]
            fan_in = tuple(a for a, i in enumerate(core) if i not in later)
            fan_out = tuple(a for a, i in enumerate(core) if i not in present and i in later)
            block = tuple(a for a in range(len(core)) if a not in fan_in and a not in fan_out)
            present = (present | set(core)) - {core[a] for a in fan_in}
            roles[k] = (block, fan_in, fan_out)
        return tuple(roles[k] for k in range(len(self.cores)))

    def core_fans(self) -> tuple[tuple[int, int], ...]:
        """Per core, ``(fan_in, fan_out)``: the sizes of its :meth:`core_roles` axes. The
        fan-ins multiply to ``in_features`` times the internal sizes, so cores of variance
        ``g_k / fan_in_k`` give W the variance ``prod(g_k) / in_features``."""
        shapes = self.core_shapes
        return tuple((math.prod(shapes[k][a] for a in ins), math.prod(shapes[k][a] for a in outs))
                     for k, (_, ins, outs) in enumerate(self.core_roles()))

    # -- records --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain lists and ints (what checkpoints and ``save_pretrained`` records store)."""
        return {"inputs": list(self.inputs), "outputs": list(self.outputs),
                "cores": [list(c) for c in self.cores], "sizes": [[n, s] for n, s in self.sizes],
                "bonds": list(self.bonds)}

    @classmethod
    def from_dict(cls, record: Mapping) -> Layout:
        """The layout :meth:`to_dict` wrote; a malformed record raises :class:`ConfigError`."""
        try:
            return cls(tuple(map(str, record["inputs"])), tuple(map(str, record["outputs"])),
                       tuple(tuple(map(str, c)) for c in record["cores"]),
                       tuple((str(n), s) for n, s in record["sizes"]),
                       tuple(map(str, record["bonds"])))
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"a layout record needs inputs, outputs, cores, sizes and bonds "
                              f"as lists; got {type(record).__name__} ({exc}).") from None

    # -- compute --------------------------------------------------------------------------------
    def equation(self) -> str:
        """The einsum of ``y = x @ W`` in letters: ``"b<inputs>,<core>,...->b<outputs>"``."""
        letters = self._letters()
        term = lambda ix: "".join(letters[i] for i in ix)  # noqa: E731
        operands = ",".join(["z" + term(self.inputs), *(term(c) for c in self.cores)])
        return f"{operands}->z{term(self.outputs)}"

    def network(self, batch: str | int = "B") -> tncomp.Network:
        """The tncomp network of ``y = x @ W``: operands ``x``, ``core1``... and output ``y``."""
        taken = dict(self.sizes)
        b = "b"
        while b in taken:  # the batch takes a label no index of the layout has
            b = "_" + b
        operands = [("x", [b, *self.inputs], tncomp.Role.INPUT)]
        operands += [(f"core{k + 1}", list(core), tncomp.Role.PARAMETER)
                     for k, core in enumerate(self.cores)]
        counts = Counter(i for _, ix, _ in operands for i in ix)
        counts.update(self.outputs)
        hyper = [i for i, n in counts.items() if n > 2]
        sizes = {b: tncomp.Dim(batch) if isinstance(batch, str) else batch, **taken}
        return tncomp.make_network(operands, ("y", [b, *self.outputs]), sizes, hyper)

    def dense(self, cores: Sequence[Tensor]) -> Tensor:
        """W as an (in_features, out_features) matrix, contracted by ``torch.einsum``."""
        letters = self._letters()
        term = lambda ix: "".join(letters[i] for i in ix)  # noqa: E731
        eq = ",".join(term(c) for c in self.cores) + "->" + term(self.inputs + self.outputs)
        w = torch.einsum(eq, *cores)
        return w.reshape(self.in_features, self.out_features)

    def _letters(self) -> dict[str, str]:
        names = list(dict(self.sizes))
        pool = [c for c in string.ascii_letters if c != "z"]
        if len(names) > len(pool):
            raise ConfigError(f"a layout of {len(names)} indices is more than einsum's "
                              f"{len(pool)} letters.")
        return dict(zip(names, pool, strict=False))
