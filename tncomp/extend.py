"""The extension interface: what a package that builds its own layers on tncomp needs besides
``tncomp.__all__``, so that its layers check and cast as tncomp's own networks do, and its
renamed names age as tncomp's do.

comera is such a package: its formats check modes and resolve TT ranks with tncomp's rules, its
layers accept tncomp's memory modes and follow the autocast rule tncomp's operators follow.

- :func:`check_modes`, :func:`resolve_ranks`: the mode and TT-rank rules of the builders.
- :func:`check_memory`: a ``memory=`` mode of ``compile``, checked.
- :func:`autocast_dtype`, :func:`autocast_cast`: the autocast rule of every call path.
- :func:`register_tree_finder`, :class:`SearchSpace`: a tree finder of one's own among the
  planner's candidates (:mod:`tncomp.compiler.finders`).
- :func:`time_calls`, :func:`device_sync`: the one timer (seconds per call, interleaved, the
  device drained before each clock read), for a package that times its own steps.
- :func:`renamed`: a module ``__getattr__`` that serves old names with a DeprecationWarning
  naming the new one and the release the old one goes in.

These names were in ``tncomp.__all__`` before; ``tncomp.check_modes`` (and the others) still
works until 0.3.0, with a DeprecationWarning (:data:`tncomp_getattr`).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from tncomp.compiler.builders import check_modes, resolve_ranks
from tncomp.compiler.finders import SearchSpace, register_tree_finder
from tncomp.compiler.memory import check_memory
from tncomp.runtime.device_timing import device_sync, time_calls
from tncomp.runtime.library import autocast_cast, autocast_dtype

__all__ = ["SearchSpace", "autocast_cast", "autocast_dtype", "check_memory", "check_modes",
           "device_sync", "register_tree_finder", "renamed", "resolve_ranks", "time_calls"]


def renamed(module: str, names: Mapping[str, tuple[str, str]]) -> Callable[[str], Any]:
    """A ``__getattr__`` for ``module`` (PEP 562) serving each old name of ``names``, ``old ->
    ("package.module:new", release it goes in)``: the new object, with a DeprecationWarning
    that names it; any other name raises AttributeError as a module does."""
    for old, (target, release) in names.items():
        if target.count(":") != 1 or not release:
            raise ValueError(f"renamed({module!r}): {old!r} -> {target!r}, {release!r}; give "
                             "'package.module:name' and the release the old name goes in.")

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        target, release = names[name]
        home, _, new = target.partition(":")
        shown = f"{home}.{new}"
        warnings.warn(f"{module}.{name} is deprecated: use {shown}; the old name goes in "
                      f"{release}.", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), new)

    return __getattr__


#: ``tncomp.__getattr__``: the extension names, importable from ``tncomp`` until 0.3.0.
tncomp_getattr = renamed("tncomp", {name: (f"tncomp.extend:{name}", "0.3.0") for name in (
    "autocast_cast", "autocast_dtype", "check_memory", "check_modes", "resolve_ranks")})
