"""What a training run leaves behind, as plain data: its :class:`RunRecord` (curves, ranks,
timings, sizes), and the engine state a checkpoint holds, read (old ones too: the ``tt`` flag's
era) and checked before a resume uses any of it."""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from comera.errors import CheckpointError, ConfigError
from comera.formats.registry import DENSE
from comera.formats.tt_flag import FLAG_FORMAT, format_from_tt
from comera.surgery.checkpoint import read_checkpoint

__all__ = ["RunRecord", "check_engine_state", "current_engine_state", "engine_state_format",
           "run_checkpoint_format"]

log = logging.getLogger("comera.engine")


@dataclass
class RunRecord:
    """Everything measured in one run; plain data (it goes into checkpoints and JSON)."""

    name: str
    format: str  # the run's layer kind: "dense" or a registered format (a CoMERA run)
    steps: int = 0
    skipped: int = 0
    step_times: list = field(default_factory=list)  # seconds, training steps only
    train_curve: list = field(default_factory=list)  # (step, loss, objective, weighted)
    val_curve: list = field(default_factory=list)  # (step, {metric: value})
    ranks: list = field(default_factory=list)  # (step, {layer: [ranks]})
    stage_ends: dict = field(default_factory=dict)  # stage -> {"step", "val", "test", "sizes"}
    sizes: dict = field(default_factory=dict)  # at the end (see sizes_of)
    # wall-clock seconds spent training (steps with their batches; evaluations and checkpoints
    # left out) by the end of the run, and at each point of val_curve
    train_seconds: float = 0.0
    val_seconds: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.format, bool):  # RunRecord(name, tt) of before: True was TT
            self.format = format_from_tt(self.format, FLAG_FORMAT, "RunRecord(name, format={})",
                                         stacklevel=4)
        if not isinstance(self.format, str):
            raise ConfigError(f"RunRecord format={self.format!r}; give the run's layer kind, "
                              "'dense' or a registered format.")

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A record pickled with the ``tt`` flag of before loads with the kind it ran: TT
        (the only format then) or dense."""
        state = dict(state)
        if "tt" in state and "format" not in state:
            state["format"] = FLAG_FORMAT if state.pop("tt") else DENSE
        self.__dict__.update(state)

    @classmethod
    def from_dict(cls, data: dict[str, Any], format: str = FLAG_FORMAT) -> RunRecord:
        """The record ``asdict`` wrote. One of before the layer kind was one word (a ``"tt"``
        flag, no ``"format"``) reads as ``format`` (True: the run's, from its config, TT where
        that names none) or ``"dense"`` (False)."""
        data = dict(data)
        if "tt" in data and "format" not in data:
            data["format"] = format if data.pop("tt") else DENSE
        return cls(**data)

    @property
    def step_ms(self) -> float:
        """Median time per training step in milliseconds (NaN when no step was timed)."""
        return statistics.median(self.step_times) * 1e3 if self.step_times else float("nan")


# what a checkpoint's engine state holds, by type (checked before any of it is used)
_ENGINE_STATE = {"task": str, "format": str, "config": dict, "trainer": dict, "step": int,
                 "rng_torch": Tensor, "rng_python": list | tuple, "record": dict}


def engine_state_format(state: dict) -> str | None:
    """The layer kind of the run an engine state (a checkpoint's ``extra["engine"]``) was saved
    from: its ``"format"``; in a state of the ``tt`` flag's era, ``"dense"`` for ``tt=False``
    and for ``tt=True`` its config's CoMERA format, or TT where the config names none (the only
    format then; never today's default). None when it names no kind (a damaged state)."""
    if "format" in state:
        return state["format"] if isinstance(state["format"], str) else None
    flag, config = state.get("tt"), state.get("config")
    if not isinstance(flag, bool) or not isinstance(config, dict):
        return None
    return str(config.get("format", FLAG_FORMAT)) if flag else DENSE


def run_checkpoint_format(path: Path | str) -> str:
    """The layer kind of the run whose checkpoint is at ``path`` (:func:`engine_state_format`
    of its engine state): what a resumed run builds when none is named. A CheckpointError when
    the file is not a readable checkpoint of the engine."""
    state = read_checkpoint(path).extra.get("engine")
    format = engine_state_format(state) if isinstance(state, dict) else None
    if format is None:
        raise CheckpointError(f"{path} was not written by the training engine (its engine "
                              "state names no layer kind); resume needs one of its "
                              "checkpoints, or start without --resume.")
    return format


def current_engine_state(state: dict, path: Path) -> dict:
    """An engine state written before the layer kind was one word (a ``"tt"`` flag beside the
    config's CoMERA ``format``) as it is written now: ``"format"`` the run's kind, in the
    config too (a dense run's config named the CoMERA run's format)."""
    if "format" in state or "tt" not in state:
        return state
    format = engine_state_format(state)
    if format is None:
        return state  # refused, as damaged, by check_engine_state
    state = dict(state)
    del state["tt"]
    state["format"] = format
    state["config"] = {**state["config"], "format": format}
    log.info("%s: an engine state with a tt flag (before 0.2.0), read as format %r", path,
             state["format"])
    return state


def check_engine_state(state: dict, path: Path) -> None:
    """Refuse an engine state of missing or mistyped entries with a CheckpointError (the
    checksum detects damage, not an edit that recomputes it)."""
    for key, kind in _ENGINE_STATE.items():
        value = state.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            expected = getattr(kind, "__name__", str(kind))
            raise CheckpointError(f"{path}: its engine state has {key} of type "
                                  f"{type(value).__name__}, expected {expected}; the file is "
                                  "damaged or was edited. Start without --resume.")
    if state["step"] < 0:
        raise CheckpointError(f"{path}: its engine state has step={state['step']}; the file is "
                              "damaged or was edited. Start without --resume.")
