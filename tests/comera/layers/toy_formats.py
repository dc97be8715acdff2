"""A toy non-chain format for the generic layer and rank tests: three cores with a hyperedge
bond (on every core), a chain link, a ring-like link between the first and last core, and a
fixed (ungated) internal link."""

from __future__ import annotations

import torch

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


class TwoFactors(Format):
    """W = A[i, r] B[r, o]: a toy non-chain layout (no size-1 ends) with a decomposition and an
    exact rounding, both by SVD."""

    name, title, uses_modes, exact_decomposition = "two_factors", "two factors", False, True

    def layout(self, in_modes, out_modes, ranks) -> Layout:
        (n_in,), (n_out,) = in_modes, out_modes
        rank = ranks if isinstance(ranks, int) else ranks[0]
        return Layout(("i",), ("o",), (("i", "r"), ("r", "o")),
                      (("i", n_in), ("o", n_out), ("r", rank)), ("r",))

    def decompose(self, weight, layout):
        u, s, vh = torch.linalg.svd(weight, full_matrices=False)
        keep = min(layout.size("r"), int((s > 1e-12 * s[0]).sum()))
        return [u[:, :keep] * s[:keep], vh[:keep]]

    def round(self, cores, layout):
        return self.decompose(cores[0] @ cores[1], layout)


TWO = TwoFactors()
