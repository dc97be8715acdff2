"""Checkpoints as the code of before wrote them, for the tests that they still resume and load."""

from __future__ import annotations

from pathlib import Path

from comera.surgery.checkpoint import checkpoint_payload
from comera.torchfile import read_torch_file, write_torch_file


def write_engine_state_as_before_formats(path: Path, config_format: bool = True) -> None:
    """Rewrite the engine state of the run checkpoint at ``path`` (a TT or a dense run) as the
    engine wrote it before the layer kind was one word (issue 43): a ``"tt"`` flag and no
    ``"format"``, the config's ``format`` the CoMERA run's (``"tt"``) in a dense run too, the
    record with ``tt``. ``config_format=False``: the config has no ``format`` at all, as before
    EngineConfig had one (TT the only format)."""
    payload = read_torch_file(path)
    engine = payload["extra"]["engine"]
    flag = engine.pop("format") != "dense"
    engine["tt"] = flag
    engine["config"]["format"] = "tt"
    if not config_format:
        del engine["config"]["format"]
    engine["record"].pop("format")
    engine["record"]["tt"] = flag
    optimizer = {k: payload[k] for k in ("optimizer", "optimizer_class",
                                         "optimizer_param_names")}
    write_torch_file(path, checkpoint_payload(payload["model"], payload["layers"], optimizer,
                                              payload["extra"]))
