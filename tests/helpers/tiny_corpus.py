"""A tiny folder of Python sources with files in each of the stdlib corpus's splits, for tests
of loaders that read a source tree (no dependence on the machine's standard library)."""

from __future__ import annotations

import random
from pathlib import Path

from comera.data.stdlib_pairs import split_of

WORDS = ("alpha", "beta", "gamma", "delta", "count", "value", "items", "total", "index",
         "result", "buffer", "offset", "length", "reader", "writer", "parse", "format", "check",
         "token", "stream", "record", "field", "table", "cache")


def _source(rng: random.Random, functions: int) -> str:
    lines = ['"""A generated module."""', ""]
    for _ in range(functions):
        name, arg, other = rng.sample(WORDS, 3)
        lines += [f"def {name}_{other}({arg}, {other}=0):",
                  f'    """Return the {name} of {arg}."""',
                  f"    {name} = {arg} + {other} * {rng.randint(1, 9)}",
                  f"    if {name} > {rng.randint(10, 99)}:",
                  f"        return {name} - {other}",
                  f"    return [{arg}, {name}, {other}]", ""]
    return "\n".join(lines)


def write_tiny_corpus(root: Path, per_split: int = 2, functions: int = 12,
                      seed: int = 0) -> dict[str, list[str]]:
    """Write ``per_split`` modules per split (train, val, test) under ``root``; returns the
    module paths of each split (chosen by the corpus's own hash rule)."""
    rng = random.Random(seed)
    chosen: dict[str, list[str]] = {"train": [], "val": [], "test": []}
    k = 0
    while min(len(v) for v in chosen.values()) < per_split:
        module = f"pkg{k % 3}/mod_{k}.py"
        k += 1
        split = split_of(module)
        if len(chosen[split]) < per_split:
            chosen[split].append(module)
            path = root / module
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(_source(rng, functions), encoding="utf-8")
    return chosen
