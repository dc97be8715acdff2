"""Permute copies on the CPU as 2-D transposes, the one copy torch runs cache-blocked.

torch copies a permuted view element by element in the output's order; when the permute moves
the innermost axis, every read then jumps by a large stride, and a copy of a BTT
intermediate ``(8, 12, 16, 4096) -> (4096, 12, 16, 8)`` runs many times slower than a plain
copy (docs/results.md, "Measured rules of the CPU executor"). Its 2-D transpose
(``out.copy_(a.t())`` of a contiguous matrix) is blocked. A plan's permute is usually one swap of
two blocks of axes (:func:`tncomp.compiler.ops.as_swap`): it runs as ``lead`` such 2-D transposes,
into a buffer the caller owns (a pooled one).
"""

from __future__ import annotations

import torch

from tncomp.compiler.ops import Swap, blocked


def permute_into(out: torch.Tensor, src: torch.Tensor, shape: tuple[int, ...],
                 perm: tuple[int, ...], swap: Swap | None) -> torch.Tensor:
    """``out`` (contiguous) filled with ``src.reshape(shape).permute(perm)``: as ``swap.lead``
    blocked 2-D transposes when :func:`~tncomp.compiler.ops.blocked`, else one copy."""
    if blocked(swap):
        s = src.reshape(swap.lead, swap.x, swap.y)  # (lead, x, y)
        o = out.view(swap.lead, swap.y, swap.x)  # (lead, y, x)
        for k in range(swap.lead):
            o[k].copy_(s[k].t())
        return out
    return out.copy_(src.reshape(shape).permute(perm))
