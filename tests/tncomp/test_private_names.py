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

from tests.helpers.imports import reach_ins
from tests.tncomp.test_layering import MODULES


def _parse(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), filename=str(path))


def test_no_module_reads_another_modules_private_names():
    found = reach_ins({module: _parse(path) for module, path in MODULES.items()}, "tncomp")
    assert not found, ("private names used across tncomp modules (make them public in their "
                       "home, or move the code):\n" + "\n".join(found))


def test_the_checker_catches_a_planted_reach_in():
    """Not vacuous: a private import, a private method read from another module's class, and
    the same read in the module that defines it (allowed)."""
    home = ast.parse("class C:\n    def _secret(self):\n        return self._secret\n")
    user = ast.parse("from tncomp.home import _helper, public\n"
                     "def f(c):\n    return c._secret()\n")
    found = reach_ins({"tncomp.home": home, "tncomp.user": user}, "tncomp")
    assert found == ["tncomp.user:1: imports tncomp.home._helper",
                     "tncomp.user:3: reads ._secret of ['tncomp.home']"]
