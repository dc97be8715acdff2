"""CoMERA rank adaptation inside HuggingFace ``Trainer`` (the ``hf`` extra).

    comera.convert_(model, ranks=16)                       # a transformers model
    callback = CoMERACallback(target_compression=10, late_start=300)
    trainer = Trainer(model, args, train_dataset=data, callbacks=[callback])
    trainer.train()                                        # early stage, then late stage
    comera.save_pretrained(model, "out/tt-model")          # the trained, truncated model

The callback drives a :class:`~comera.training.controller.RankController` (see
:mod:`comera.integrations.schedule`): the early stage's ``lam * R`` (and the late stage's size
term) reach the gradients just before each optimizer step, after ``late_start`` steps the pruned
ranks are truncated with the optimizer state and the late stage lands on the compression target
within ``late_steps``. ``Trainer`` logs its plain loss; the callback adds ``objective``, ``size``,
``compression``, ``rank_total`` and ``late_stage``.

Checkpoints: ``Trainer``'s own checkpoints keep the TT layers, and ``resume_from_checkpoint``
restores a truncated model exactly (its TT layers take the saved bonds as they load, see
:mod:`comera.integrations.bonds`; the controller's stage rides in ``trainer_state.json``).
Each checkpoint's weights also carry a zero-size ``<layer>.weight`` per TT layer, so that
``from_pretrained`` of a checkpoint folder refuses it (a size mismatch naming the layer) instead
of building dense layers with fresh random weights. To publish the model, use
:func:`comera.save_pretrained` / :func:`comera.from_pretrained`. Gradients with fp16 loss
scaling are not supported (bf16 and fp32 are).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from comera.errors import ConfigError
from comera.integrations.bonds import SENTINEL, follow_saved_bonds_
from comera.integrations.schedule import StageDriver, StageSchedule, has_tt_layers
from comera.ranks.size import gated_layers

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError as exc:  # pragma: no cover - the hf extra is missing
    raise ImportError("comera.integrations.hf needs transformers: pip install 'tncomp[hf]'.") \
        from exc

__all__ = ["CoMERACallback", "mark_checkpoint"]


class CoMERACallback(TrainerCallback, ExportableState):
    """Rank-adaptive training in ``transformers.Trainer``; the arguments are those of
    :class:`~comera.integrations.schedule.StageSchedule`."""

    def __init__(self, target_compression: float | None = None, late_start: int | None = None,
                 late_steps: int | None = None, lam: float = 0.01, regularizer: str = "l1",
                 min_rank: int = 1, target_loss: float | None = None):
        self.schedule = StageSchedule(target_compression, late_start, late_steps, lam,
                                      regularizer, min_rank, target_loss)
        self.driver: StageDriver | None = None
        self.controller_state: dict[str, Any] | None = None  # restored by Trainer, if asked
        self._hooks: list[Any] = []

    # -- set up ------------------------------------------------------------------------------
    def on_init_end(self, args, state, control, model=None, **kwargs):
        if model is None or not has_tt_layers(model):
            raise ConfigError("CoMERACallback: the model has no TT layers; convert it with "
                              "comera.convert_(model, ...) before building the Trainer.")
        follow_saved_bonds_(model)  # resume_from_checkpoint loads truncated layers

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.driver = StageDriver(self.schedule, model, optimizer, state.max_steps or None)
        saved = self.controller_state or self._saved_in(state)
        if saved is not None and state.global_step > 0:
            self.driver.controller.load_state_dict(saved)
        self._hooks = [model.register_forward_hook(self._see_output)]

    def _saved_in(self, state) -> dict[str, Any] | None:
        """The controller state stored in a resumed ``TrainerState`` (None when none)."""
        entry = state.stateful_callbacks.get(type(self).__name__)
        if isinstance(entry, list):
            entry = entry[-1] if entry else None
        return (entry or {}).get("attributes", {}).get("controller_state")

    def _see_output(self, module, inputs, output) -> None:
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if module.training and loss is not None and self.driver is not None:
            self.driver.saw_loss(loss)

    # -- each step ---------------------------------------------------------------------------
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.driver.before_optimizer_step()

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.driver.after_optimizer_step(state.global_step + 1, optimizer)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.driver is None or logs is None or "loss" not in logs:
            return
        extra = self.driver.log_values(float(logs["loss"]))
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)

    def on_train_end(self, args, state, control, **kwargs):
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # -- checkpoints ---------------------------------------------------------------------------
    def on_save(self, args, state, control, model=None, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir() and model is not None:
            mark_checkpoint(folder, [name for name, _ in gated_layers(model)])

    def state(self) -> dict[str, Any]:
        """What ``trainer_state.json`` keeps: the schedule and the controller's state."""
        s = self.schedule
        args = {"target_compression": s.target_compression, "late_start": s.late_start,
                "late_steps": s.late_steps, "lam": s.lam, "regularizer": s.regularizer,
                "min_rank": s.min_rank, "target_loss": s.target_loss}
        controller = None if self.driver is None else self.driver.controller.state_dict()
        return {"args": args, "attributes": {"controller_state": controller}}


def mark_checkpoint(folder: str | os.PathLike, layers: list[str]) -> None:
    """Add a zero-size ``<layer>.weight`` for each TT layer to a ``Trainer`` checkpoint's
    safetensors weights, so HuggingFace's ``from_pretrained`` refuses the folder (a size
    mismatch) rather than re-initialising those layers; ``resume_from_checkpoint`` drops them
    again (:mod:`comera.integrations.bonds`)."""
    import safetensors.torch
    import torch
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # sharded: the markers go into the first shard
        record = json.loads(index.read_text())
        target = folder / sorted(set(record["weight_map"].values()))[0]
    else:
        target = folder / "model.safetensors"
        record = None
    if not target.is_file() or not layers:
        return
    with safe_open(str(target), framework="pt") as f:
        metadata = f.metadata() or {"format": "pt"}
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iter)
    for name in layers:
        tensors.setdefault(f"{name}.{SENTINEL}", torch.empty(0))
    safetensors.torch.save_file(tensors, str(target), metadata=metadata)
    if record is not None:
        for name in layers:
            record["weight_map"].setdefault(f"{name}.{SENTINEL}", target.name)
        index.write_text(json.dumps(record, indent=2))
