"""What the engine stored and computed before EngineConfig was grouped: the fixtures of
``test_engine_before.py``.

``data/engine_before/`` was written by :func:`write` with main's code of fac7af5, when
``EngineConfig`` was one flat class of 33 fields:

- ``config.pkl``: a config (every group with values off their defaults) pickled by that class;
- ``config.json``: ``dataclasses.asdict`` of it, as checkpoints and summaries store it;
- ``checkpoint.pt``: the run checkpoint of that config on :class:`ToyTask`, stopped at step
  ``STOP`` (inside the early stage, so a resume computes the late stage's loss target);
- ``run.pt``: the train curve, ranks and final parameters of the same run uninterrupted.

Regenerate only on purpose, from a checkout of the code whose behaviour is pinned:

    PYTHONPATH=$PWD python tests/comera/experiments/engine_before.py
"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

DATA = Path(__file__).parent / "data" / "engine_before"
STOP = 10  # the early stage is steps 0..11
# every group of the grouped class off its defaults: schedule, ranks, late stage, runtime, run
SETTINGS = dict(steps_early=12, steps_late=8, batch_size=16, lr=1e-2, lr_gates=0.1,
                lr_other=5e-3, warmup=2, schedule="cosine", max_grad_norm=0.5,
                lam=20.0, regularizer="size_weighted", early_landing=0.4,
                target_compression=3.0, late_loss_slack=0.1, late_landing=0.6,
                late_allocation="prune",  # the default when the fixtures were written
                format="tt",  # the default when the fixtures were written (ttm since issue 40)
                memory="balanced", threads=1,
                seed=3, eval_every=5, checkpoint_every=4, on_nonfinite="skip", max_skips=3)


def write() -> None:
    """Write the fixtures with the ``comera`` on the path (see the module's docstring)."""
    from comera.experiments.engine import EngineConfig, train_model
    from tests.helpers.toy_task import ToyTask

    torch.set_num_threads(1)
    config = EngineConfig(**SETTINGS)
    DATA.mkdir(parents=True, exist_ok=True)
    (DATA / "config.pkl").write_bytes(pickle.dumps(config))
    (DATA / "config.json").write_text(json.dumps(asdict(config), indent=1) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        whole, record = train_model(ToyTask(), "comera", config, Path(tmp) / "whole")
        train_model(ToyTask(), "comera", config, Path(tmp) / "stopped", stop_after=STOP)
        shutil.copy(Path(tmp) / "stopped" / "checkpoints" / "comera.pt", DATA / "checkpoint.pt")
    torch.save({"train_curve": record.train_curve, "ranks": record.ranks,
                "params": {k: v.detach().clone() for k, v in whole.state_dict().items()}},
               DATA / "run.pt")


if __name__ == "__main__":
    sys.path.insert(0, str(Path.cwd()))
    write()
