"""What a package's modules import, read from the source with ``ast`` (so it cannot rot).

Shared by the layering tests of tncomp and comera: module names from paths, every import with
whether it runs at import time, the first import cycle among a package's modules, and private
names one module takes from another.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(package: str) -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path, known: set[str] | dict[str, Path]) -> list[tuple[str, bool]]:
    """Every module ``path`` imports, with whether the import runs when the module is imported
    (module level, outside ``if TYPE_CHECKING``) or later (inside a function, or typing only).
    ``from a import b`` also counts ``a.b`` when that is one of the ``known`` modules."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, eager: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((alias.name, eager) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                assert child.level == 0, f"{path}: use absolute imports"
                base = child.module or ""
                found.append((base, eager))
                for alias in child.names:
                    if f"{base}.{alias.name}" in known:
                        found.append((f"{base}.{alias.name}", eager))
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) or (
                    isinstance(child, ast.If) and _is_type_checking(child)):
                visit(child, False)  # runs later, or never
            else:
                visit(child, eager)

    visit(ast.parse(path.read_text(), filename=str(path)), True)
    return found


def first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import cycle of ``graph`` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for nxt in sorted(graph[module]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := walk(nxt, [*path, nxt])):
                return cycle
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := walk(module, [module])):
            return cycle
    return None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined(tree: ast.AST) -> set[str]:
    """The private names a module defines: functions, classes, assigned names and attributes
    (``self._x = ...``), parameters."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return {n for n in names if _private(n)}


def reach_ins(trees: dict[str, ast.AST], package: str,
              allowed: frozenset[str] = frozenset()) -> list[str]:
    """Every private name a module of ``trees`` (module name -> parsed source) takes from
    another module of ``package``, as ``"module:line: what"``. Reads through ``self`` / ``cls``
    (a class's own, or inherited, members) and the ``allowed`` names are not reach-ins."""
    defined = {module: _defined(tree) for module, tree in trees.items()}
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == package:
                found.extend(f"{module}:{node.lineno}: imports {node.module}.{alias.name}"
                             for alias in node.names if _private(alias.name))
            elif (isinstance(node, ast.Attribute) and _private(node.attr)
                  and node.attr not in defined[module] and node.attr not in allowed
                  and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                homes = sorted(m for m, names in defined.items()
                               if m != module and node.attr in names)
                if homes:
                    found.append(f"{module}:{node.lineno}: reads .{node.attr} of {homes}")
    return found
