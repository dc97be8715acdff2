"""Autotune: time the best few candidate plans on the device and keep the fastest.

The device model ranks candidates; measurement settles the top few, since FLOP-optimal (and
even model-optimal) is not time-optimal. The winner is stored in the disk cache under the
binding (sizes, gradients, dtype, device), so a process pays for the timing once.
"""

from __future__ import annotations

import logging

import torch

from tncomp.compiler.plan import lower
from tncomp.compiler.problem import Problem, Tree
from tncomp.compiler.search import choose_plan
from tncomp.runtime.calibrate import median_time
from tncomp.runtime.codegen import generate

log = logging.getLogger("tncomp.runtime.autotune")

TOP_K = 3
REPEATS = 5


def _time_plan(plan, shapes, dtype, device, repeats: int = REPEATS) -> float:
    code = generate(plan, shapes, dtype, device, name="autotune", pool=True)
    operands = [torch.randn(s, dtype=dtype, device=device) for s in shapes]
    dy = torch.randn(plan.output_shape, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def step():
        y, saved = code.forward(*operands)
        if any(plan.needs_grad):
            code.backward(operands, saved, dy)
        return y

    return median_time(step, repeats, sync)


def autotune_tree(compiled, problem: Problem, sizes, needs_grad, dtype, device, model,
                  default: Tree) -> Tree:
    """The measured-fastest of the model's top candidates (and ``default``)."""
    key = ("autotune", compiled._key, tuple(sorted(sizes.items())), tuple(needs_grad),
           str(dtype), torch.device(device).type, compiled.options.optimize)
    disk = compiled._disk
    stored = disk.load(key) if disk else None
    if stored is not None:
        return Tree(stored["n"], tuple(tuple(s) for s in stored["steps"]))
    itemsize = torch.empty((), dtype=dtype).element_size()
    choice = choose_plan(problem, needs_grad, itemsize, model)
    trees = [default, *[t for t, _ in choice.candidates if t != default][:TOP_K - 1]]
    shapes = [tuple(sizes[i] for i in t.indices) for t in compiled.network.operands]
    timed = []
    for tree in trees:
        plan = lower(problem, tree, needs_grad, itemsize, model=model)
        timed.append((_time_plan(plan, shapes, dtype, device), tree))
    timed.sort(key=lambda tt: tt[0])
    log.debug("autotune: %s", [(f"{t * 1e3:.3f} ms", tr.steps) for t, tr in timed])
    best = timed[0][1]
    if disk:
        disk.store(key, {"n": best.n_leaves, "steps": [list(s) for s in best.steps],
                         "times": [t for t, _ in timed]})
    return best
