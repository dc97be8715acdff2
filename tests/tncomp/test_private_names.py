"""No tncomp module reaches into another's private names, read from the source with ``ast``.

A leading-underscore name is private to the module that defines it. Two reach-ins are caught:
``from tncomp.x import _name`` (any private name imported from a tncomp module), and an
attribute read ``obj._name`` in a module that never defines ``_name`` while another tncomp
module does (``compiled._runner_for`` in the runtime, where ``_runner_for`` is a method of the
face's ``CompiledNetwork``). What is shared is public in its home, with a docstring.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.tncomp.test_layering import MODULES


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


def reach_ins(trees: dict[str, ast.AST]) -> list[str]:
    """Every private name a module of ``trees`` (module name -> parsed source) takes from
    another, as ``"module:line: what"``."""
    defined = {module: _defined(tree) for module, tree in trees.items()}
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tncomp":
                found.extend(f"{module}:{node.lineno}: imports {node.module}.{alias.name}"
                             for alias in node.names if _private(alias.name))
            elif (isinstance(node, ast.Attribute) and _private(node.attr)
                  and node.attr not in defined[module]):
                homes = sorted(m for m, names in defined.items()
                               if m != module and node.attr in names)
                if homes:
                    found.append(f"{module}:{node.lineno}: reads .{node.attr} of {homes}")
    return found


def _parse(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), filename=str(path))


def test_no_module_reads_another_modules_private_names():
    found = reach_ins({module: _parse(path) for module, path in MODULES.items()})
    assert not found, ("private names used across tncomp modules (make them public in their "
                       "home, or move the code):\n" + "\n".join(found))


def test_the_checker_catches_a_planted_reach_in():
    """Not vacuous: a private import, a private method read from another module's class, and
    the same read in the module that defines it (allowed)."""
    home = ast.parse("class C:\n    def _secret(self):\n        return self._secret\n")
    user = ast.parse("from tncomp.home import _helper, public\n"
                     "def f(c):\n    return c._secret()\n")
    found = reach_ins({"tncomp.home": home, "tncomp.user": user})
    assert found == ["tncomp.user:1: imports tncomp.home._helper",
                     "tncomp.user:3: reads ._secret of ['tncomp.home']"]
