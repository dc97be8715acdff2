"""The layering of tncomp, read from the source with ``ast`` (so it cannot rot).

Allowed direction of imports (a module may import its own layer and the layers below it):

    face      tncomp/__init__.py, api.py,          -> anything in tncomp
              inspection.py, cli.py, extend.py
    runtime   tncomp/runtime/*                      -> runtime, compiler, base
    views     tncomp/views/*                        -> views, compiler, base
    compiler  tncomp/compiler/*                     -> compiler, base
    base      tncomp/errors.py, tncomp/files.py     -> base

runtime and views are siblings: neither imports the other (views take plans and tables as
values; the face compiles). Function-level (lazy) and typing-only imports count like
module-level ones; the face is the top, so only it may import anything. Besides: no import
cycle between tncomp modules, no module of tncomp/compiler imports torch (directly, or through
a tncomp module it imports at import time), and tncomp never imports comera.
tncomp/__init__.py only re-exports: a docstring, imports, ``__all__`` and ``__version__``.
"""

from __future__ import annotations

import ast

import pytest

from tests.helpers import ROOT
from tests.helpers.imports import imports, package_modules

PACKAGE = ROOT / "tncomp"
FACE = {"tncomp", "tncomp.api", "tncomp.inspection", "tncomp.cli", "tncomp.extend"}
BASE = {"tncomp.errors", "tncomp.files"}
ALLOWED = {  # layer -> the layers it may import
    "base": {"base"},
    "compiler": {"compiler", "base"},
    "runtime": {"runtime", "compiler", "base"},
    "views": {"views", "compiler", "base"},
}


MODULES = package_modules("tncomp")


def _layer(module: str) -> str:
    if module in FACE:
        return "face"
    if module in BASE:
        return "base"
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in ALLOWED:
        return parts[1]
    raise AssertionError(f"{module} belongs to no layer; add it to the layering test.")


IMPORTS = {m: imports(p, MODULES) for m, p in MODULES.items()}


def _tncomp_imports(module: str, eager_only: bool = False) -> set[str]:
    return {name for name, eager in IMPORTS[module]
            if name in MODULES and name != module and (eager or not eager_only)}


def test_every_module_has_a_layer():
    assert {_layer(m) for m in MODULES} == {"face", "base", "compiler", "runtime", "views"}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m not in FACE))
def test_imports_go_down(module):
    allowed = ALLOWED[_layer(module)]
    upward = sorted(name for name in _tncomp_imports(module)
                    if name not in FACE and _layer(name) not in allowed)
    face = sorted(name for name in _tncomp_imports(module) if name in FACE)
    assert not upward and not face, (
        f"{module} ({_layer(module)}) imports {upward + face}; it may import only "
        f"{sorted(allowed)}")


def test_no_import_cycles():
    graph = {m: _tncomp_imports(m) - {"tncomp"} for m in MODULES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(graph[module]):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt):], nxt]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                walk(nxt, [*path, nxt])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m) == "compiler"))
def test_compiler_never_imports_torch(module):
    """Directly (even lazily), or through a tncomp module it imports at import time."""
    direct = [name for name, _ in IMPORTS[module] if name.split(".")[0] == "torch"]
    assert not direct, f"{module} imports {direct}"
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        torch = [n for n, eager in IMPORTS[current] if eager and n.split(".")[0] == "torch"]
        assert not torch, f"{module} imports torch at import time through {current}"
        todo.extend(_tncomp_imports(current, eager_only=True))


def test_tncomp_never_imports_comera():
    offenders = sorted(m for m, names in IMPORTS.items()
                       if any(n.split(".")[0] == "comera" for n, _ in names))
    assert not offenders, f"tncomp modules importing comera: {offenders}"


def _not_a_reexport(source: str) -> list[str]:
    """The statements of a package ``__init__`` that are neither its docstring, an import,
    ``__all__`` nor ``__version__`` (so code defined there, which belongs in a module)."""
    body = ast.parse(source).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return [f"line {node.lineno}: {ast.unparse(node).splitlines()[0]}" for node in body
            if not isinstance(node, ast.Import | ast.ImportFrom) and not (
                isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id in {"__all__", "__version__"})]


def test_package_init_only_reexports():
    """tncomp/__init__.py holds no code of its own: every public name has a home module."""
    extra = _not_a_reexport(MODULES["tncomp"].read_text())
    assert not extra, f"tncomp/__init__.py defines code; move it to a module: {extra}"


def test_the_reexport_checker_sees_code():
    source = ('"""doc"""\nimport x\nfrom y import z\n__all__ = ["z"]\n__version__ = "1"\n'
              "def f():\n    pass\n_cache = {}\n")
    assert _not_a_reexport(source) == ["line 6: def f():", "line 8: _cache = {}"]


def test_the_checker_sees_lazy_and_from_imports(tmp_path):
    """The parser is not vacuous: it finds eager, lazy, typing-only and submodule imports."""
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nimport torch\nfrom tncomp.views import draw\n"
        "if TYPE_CHECKING:\n    import numpy\n"
        "def f():\n    from tncomp.api import compile\n")
    found = imports(source, MODULES)
    assert ("torch", True) in found and ("tncomp.views.draw", True) in found
    assert ("numpy", False) in found and ("tncomp.api", False) in found


def test_design_doc_names_every_module_once_and_cites_only_real_files():
    """docs/design.md is code: one line per module, and no citation of a file that is absent."""
    import re

    doc = (ROOT / "docs" / "design.md").read_text()
    for module, path in MODULES.items():
        if path.name == "__init__.py" and module != "tncomp":
            continue  # a subpackage's __init__ is its folder, drawn in the diagram
        rel = path.relative_to(ROOT).as_posix()
        assert doc.count(f"`{rel}`") == 1, f"docs/design.md should name {rel} exactly once"
    cited = set(re.findall(r"[\w./-]+/[\w.-]+\.(?:py|md|json|txt)\b", doc))
    # a name (`tncomp/api.py`) is from the root; a markdown link (../benchmarks/...) from docs/
    missing = sorted(c for c in cited
                     if not (ROOT / c).exists() and not (ROOT / "docs" / c).exists())
    assert not missing, f"docs/design.md cites files not in the repository: {missing}"
