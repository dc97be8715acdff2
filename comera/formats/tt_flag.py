"""The deprecated ``tt`` flag: one home for reading it beside the layer kind, until it goes.

The layer kind is one word, ``"dense"`` or a registered format (:mod:`comera.formats.registry`).
Configs and records of before that still pass or pickle a ``tt: bool`` beside their kind field;
these helpers read it the same way everywhere (the model configs, the engine, the task
helpers), and the whole module goes in :data:`TT_FLAG_RELEASE`.

An artifact of the flag's era that stores a flag and no format (a checkpoint, a run record, a
pickled config) was built in :data:`FLAG_FORMAT`, the only format there was: its readers assume
that, never the current default of a setting, which moves with the measurements.
"""

from __future__ import annotations

import warnings
from typing import Any

from comera.errors import ConfigError
from comera.formats.registry import DENSE

__all__ = ["FLAG_FORMAT", "NO_FLAG", "TT_FLAG_RELEASE", "format_from_tt", "restore_kind_"]

#: the release in which the ``tt`` flag of the model configs and the engine goes
TT_FLAG_RELEASE = "0.3.0"
#: What ``tt=True`` built where an artifact of the flag's era names no format: CoMERA's TT, the
#: only format then (a DLRM's tables in it are TT-matrix tables)
FLAG_FORMAT = "tt"


class _NoFlag:
    """The default of a config's deprecated ``tt`` argument, and what ``cfg.tt`` reads: not a
    bool, so code that still tests the flag fails loudly, naming the field that replaced it."""

    def __bool__(self) -> bool:
        raise ConfigError("the model configs have no tt flag: the layer kind is one word, "
                          "TransformerConfig.linear_format / DLRMConfig.table_format (\"dense\" "
                          "for the dense model); test cfg.linear_format != \"dense\".")

    def __repr__(self) -> str:
        return "<no tt flag>"


NO_FLAG: Any = _NoFlag()


def format_from_tt(tt: Any, format: str, instead: str, *, stacklevel: int = 3) -> str:
    """The layer kind the deprecated ``tt`` flag asks for beside the kind ``format``: ``format``
    for True, ``"dense"`` for False, with a DeprecationWarning naming the new spelling
    (``instead``, formatted with the kind); the flag goes in :data:`TT_FLAG_RELEASE`. ``tt=True``
    beside ``"dense"`` is a :class:`ConfigError` naming both (which of the two is meant?)."""
    if not isinstance(tt, bool):
        raise ConfigError(f"tt={tt!r}: the deprecated flag is True or False; give the layer kind "
                          f"alone instead, e.g. {instead.format(repr(DENSE))}.")
    if tt and format == DENSE:
        raise ConfigError(f"tt=True beside the kind 'dense' ({instead.format(repr(DENSE))}): "
                          "the flag asks for a compressed model, the kind for the dense one; "
                          "drop tt and give the kind alone (a registered format, or 'dense').")
    kind = format if tt else DENSE
    warnings.warn(f"tt={tt} is deprecated: the layer kind is one word, give "
                  f"{instead.format(repr(kind))}; the tt flag goes in {TT_FLAG_RELEASE}.",
                  DeprecationWarning, stacklevel=stacklevel)
    return kind


def restore_kind_(config: Any, state: dict[str, Any], field: str,
                  flag_kind: str = FLAG_FORMAT) -> None:
    """``__setstate__`` of a model config pickled before the layer kind was one word (a ``tt``
    flag beside the kind ``field``): it loads as the kind it built, ``tt=False`` the dense one,
    ``tt=True`` the kind it stored, or ``flag_kind`` (what the flag built) where it stored none
    (pickled before the kind had a field), never the field's current default."""
    state = dict(state)
    flag = state.pop("tt", None)
    if flag is False:
        state[field] = DENSE
    elif flag is True and field not in state:
        state[field] = flag_kind
    config.__dict__.update(state)
