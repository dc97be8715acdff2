"""The floors of comera, read from the source with ``ast`` (so they cannot rot).

A module may import its own floor and the floors below it, never one above:

    cli           comera/cli.py                         the `comera` command
    experiments   comera/experiments/*                  tasks, the engine, results, run folders
    api           comera/__init__.py                    the public names (re-exports only)
    models        comera/models/*                       the paper's models
    data          comera/data/*                         data sets, tokenizers, caches
    integrations  comera/integrations/*                 callbacks for other people's trainers
    surgery       comera/surgery/*                      conversion, swapping, checkpoints, files
    training      comera/training/*                     controller, trainers, optimizer state
    ranks         comera/ranks/*                        size, objective, pruning, truncation
    layers        comera/layers/*                       torch modules with rank gates
    formats       comera/formats/*                      how a weight is factored
    lean          comera/lean/*                         memory-lean versions of torch ops
    base          comera/{errors,torchfile,batches,numbers}.py  exceptions, files, batches, ints

Function-level (lazy) and typing-only imports count like module-level ones. Besides: no import
cycle between comera modules, and comera/__init__.py only re-exports.
"""

from __future__ import annotations

import ast

import pytest

from tests.helpers import ROOT
from tests.helpers.imports import first_cycle, imports, package_modules, reach_ins

FLOORS = ("base", "lean", "formats", "layers", "ranks", "training", "surgery", "integrations",
          "data", "models", "api", "experiments", "cli")
SPECIAL = {"comera": "api", "comera.cli": "cli", "comera.errors": "base",
           "comera.torchfile": "base", "comera.batches": "base",
           "comera.numbers": "base"}
MODULES = package_modules("comera")
IMPORTS = {m: imports(p, MODULES) for m, p in MODULES.items()}


def _floor(module: str) -> str:
    if module in SPECIAL:
        return SPECIAL[module]
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in FLOORS:
        return parts[1]
    raise AssertionError(f"{module} belongs to no floor; add it to comera's layering test.")


def _comera_imports(module: str) -> set[str]:
    return {name for name, _ in IMPORTS[module] if name in MODULES and name != module}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down(module):
    level = FLOORS.index(_floor(module))
    upward = sorted(name for name in _comera_imports(module)
                    if FLOORS.index(_floor(name)) > level)
    assert not upward, (f"{module} ({_floor(module)}) imports {upward}, which sit above it; "
                        f"it may import only {list(FLOORS[:level + 1])}")


def test_no_import_cycles():
    graph = {m: _comera_imports(m) - {"comera"} for m in MODULES}
    cycle = first_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_package_face_only_reexports():
    tree = ast.parse((ROOT / "comera" / "__init__.py").read_text())
    allowed = (ast.ImportFrom, ast.Import, ast.Assign, ast.Expr)  # imports, __all__, docstring
    extra = [type(node).__name__ for node in tree.body if not isinstance(node, allowed)]
    assert not extra, f"comera/__init__.py should only re-export; it also has {extra}"


def test_the_checker_sees_upward_imports(tmp_path):
    """Not vacuous: a lazy import of the engine from a layer module is seen as going up."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from comera.experiments import engine\n")
    found = imports(probe, MODULES)
    assert ("comera.experiments.engine", False) in found
    assert FLOORS.index(_floor("comera.experiments.engine")) > FLOORS.index("layers")


def test_design_doc_names_every_module_once():
    """Every module has its line, except the built-in formats' modules: the registry's BUILTIN
    list names those, so a new format is its module, one line there and its test."""
    from comera.formats.registry import BUILTIN

    formats = {entry.split(":")[0] for entry in BUILTIN}
    doc = (ROOT / "docs" / "design.md").read_text()
    for module, path in MODULES.items():
        if path.name == "__init__.py" and path.parent.name != "comera":
            continue  # a subpackage's __init__ is its folder
        if module in formats:
            assert doc.count(f"`{path.relative_to(ROOT).as_posix()}`") <= 1
            continue
        rel = path.relative_to(ROOT).as_posix()
        assert doc.count(f"`{rel}`") == 1, f"docs/design.md should name {rel} exactly once"


# torch's own private attributes that a comera module mirrors and conversion reads on torch's
# modules (nn.MultiheadAttention's packed-projection flag)
TORCH_PRIVATE = frozenset({"_qkv_same_embed_dim"})
TNCOMP_FACE = {"tncomp", "tncomp.errors", "tncomp.extend", "tncomp.files"}  # extend: for packages


def test_no_module_takes_another_modules_private_names():
    trees = {m: ast.parse(p.read_text(), filename=str(p)) for m, p in MODULES.items()}
    found = reach_ins(trees, "comera", TORCH_PRIVATE)
    assert not found, ("private names used across comera modules (make them public in their "
                       "home, or move the code):\n" + "\n".join(found))


def test_comera_uses_only_tncomp_public_modules():
    reach = sorted(f"{m} imports {name}" for m, names in IMPORTS.items() for name, _ in names
                   if name.split(".")[0] == "tncomp" and name not in TNCOMP_FACE)
    assert not reach, f"comera reaches into tncomp's internals: {reach}"
