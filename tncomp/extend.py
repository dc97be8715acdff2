"""The extension interface: what a package that builds its own layers on tncomp needs besides
``tncomp.__all__``, so that its layers check and cast as tncomp's own networks do.

comera is such a package: its formats check modes and resolve TT ranks with tncomp's rules, its
layers accept tncomp's memory modes and follow the autocast rule tncomp's operators follow.

- :func:`check_modes`, :func:`resolve_ranks`: the mode and TT-rank rules of the builders.
- :func:`check_memory`: a ``memory=`` mode of ``compile``, checked.
- :func:`autocast_dtype`, :func:`autocast_cast`: the autocast rule of every call path.

These names were in ``tncomp.__all__`` before; ``from tncomp import check_modes`` (and the
others) still works for one release.
"""

from tncomp.compiler.builders import check_modes, resolve_ranks
from tncomp.compiler.memory import check_memory
from tncomp.runtime.library import autocast_cast, autocast_dtype

__all__ = ["autocast_cast", "autocast_dtype", "check_memory", "check_modes", "resolve_ranks"]
