"""The greedy finders, cheap enough to be candidates always: opt_einsum's greedy, and the
layout-aware greedy of :mod:`tncomp.compiler.layouts` (the same pairs, avoiding copies) up to
:data:`LAYOUT_GREEDY_LIMIT` operands (its pair scores are cubic in them)."""

from __future__ import annotations

import opt_einsum

from tncomp.compiler.layouts import layout_greedy
from tncomp.compiler.problem import Tree

LAYOUT_GREEDY_LIMIT = 64


def greedy_finder(space) -> list[Tree]:
    return [space.tree(opt_einsum.paths.greedy(list(space.inputs), space.output, space.sizes))]


def layout_greedy_finder(space) -> list[Tree]:
    return [layout_greedy(space.problem)] if space.n <= LAYOUT_GREEDY_LIMIT else []
