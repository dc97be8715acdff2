"""A toy non-chain format for the generic layer and rank tests: three cores with a hyperedge
bond (on every core), a chain link, a ring-like link between the first and last core, and a
fixed (ungated) internal link."""

from __future__ import annotations

from comera.formats.layout import Layout
from comera.formats.registry import Format


class Toy(Format):
    """W[i1 i2, o1 o2] = sum A[c, i1, a, f] B[i2, a, o2, e] C[e, f, o1, a, c]."""

    name, title = "toy", "toy network"

    def layout(self, in_modes, out_modes, ranks) -> Layout:
        (i1, i2), (o1, o2) = in_modes, out_modes
        a, e, c = (ranks,) * 3 if isinstance(ranks, int) else ranks
        sizes = {"i1": i1, "i2": i2, "o1": o1, "o2": o2, "a": a, "e": e, "c": c, "f": 2}
        return Layout(("i1", "i2"), ("o1", "o2"),
                      (("c", "i1", "a", "f"), ("i2", "a", "o2", "e"),
                       ("e", "f", "o1", "a", "c")),
                      tuple(sizes.items()), ("a", "e", "c"))


TOY = Toy()
