"""CoMERA rank adaptation inside HuggingFace ``Trainer`` (the ``hf`` extra).

    comera.convert_(model, ranks=16)                       # a transformers model
    callback = CoMERACallback(target_compression=10, late_start=300)
    trainer = Trainer(model, args, train_dataset=data, callbacks=[callback])
    trainer.train()                                        # early stage, then late stage
    trainer.save_model("out/tt-model")                     # comera.from_pretrained reads it

The callback drives a :class:`~comera.training.controller.RankController` (see
:mod:`comera.integrations.stage_callback`): the early stage's ``lam * R`` (and the late stage's size
term) reach the gradients just before each optimizer step, after ``late_start`` steps the pruned
ranks are truncated with the optimizer state and the late stage lands on the compression target
within ``late_steps``. ``Trainer`` logs its plain loss; the callback adds ``objective``, ``size``,
``compression`` (the TT layers', which ``target_compression`` refers to), ``model_compression``
(the whole model's), ``rank_total`` and ``late_stage``. A target the run cannot reach is a
warning (when training begins if it is known then, else when it ends); a resumed run with
changed settings is refused after the late stage began and warned about before.

Saving: the callback makes the model's ``save_pretrained`` (called by ``trainer.save_model()``
and by every checkpoint) also write :func:`comera.save_pretrained`'s files, so
``comera.from_pretrained(folder, cls)`` reads any saved folder, and mark each TT layer in
HuggingFace's weights (safetensors or a transformers 4.x ``.bin``, any variant, sharded or not)
with a zero-size ``<layer>.weight``, so HuggingFace's own
``from_pretrained`` refuses the folder (a size mismatch naming the layer) instead of building
dense layers with fresh random weights. ``resume_from_checkpoint`` restores a truncated model
exactly from HuggingFace's files (its TT layers take the saved bonds as they load, see
:mod:`comera.integrations.bonds`; the controller's stage and the settings ride in
``trainer_state.json``). Gradients with fp16 loss scaling are not supported (bf16 and fp32 are).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from comera.errors import ConfigError
from comera.integrations.bonds import SENTINEL, follow_saved_bonds_
from comera.integrations.stage_callback import StageCallback, has_tt_layers
from comera.ranks.size import gated_layers
from comera.surgery.pretrained import save_pretrained
from comera.torchfile import read_torch_file, write_torch_file
from tncomp.files import atomic_write_bytes, atomic_write_text

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError as exc:  # pragma: no cover - the hf extra is missing
    raise ImportError("comera.integrations.hf needs transformers: pip install -e '.[hf]' in "
                      "the comera checkout.") from exc

__all__ = ["CoMERACallback", "ComeraSavePretrained", "mark_checkpoint", "saves_comera_files_"]


class CoMERACallback(StageCallback, TrainerCallback, ExportableState):
    """Rank-adaptive training in ``transformers.Trainer``; the arguments are those of
    :class:`~comera.integrations.stage_callback.StageSchedule`."""

    controller_state: dict[str, Any] | None = None  # set by Trainer when it restores callbacks
    _hooks: tuple[Any, ...] = ()

    # -- set up ------------------------------------------------------------------------------
    def on_init_end(self, args, state, control, model=None, **kwargs):
        """Refuse a model without TT layers; make its layers take saved bonds on load and its
        ``save_pretrained`` write comera's files too."""
        if model is None or not has_tt_layers(model):
            raise ConfigError("CoMERACallback: the model has no TT layers; convert it with "
                              "comera.convert_(model, ...) before building the Trainer.")
        follow_saved_bonds_(model)  # resume_from_checkpoint loads truncated layers
        saves_comera_files_(model)  # trainer.save_model() writes what comera reads

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        """Build the driver, restoring (and checking) a resumed run's state and settings."""
        entry = self._saved_in(state)
        controller = self.controller_state or entry.get("attributes", {}).get("controller_state")
        self.begin_training(model, optimizer, state.max_steps or None, state.global_step,
                            controller, entry.get("args"))
        self._hooks = (model.register_forward_hook(self._see_output),)

    def _saved_in(self, state) -> dict[str, Any]:
        """This callback's entry in a resumed ``TrainerState`` ({} when none)."""
        entry = state.stateful_callbacks.get(type(self).__name__)
        if isinstance(entry, list):
            entry = entry[-1] if entry else None
        return entry if isinstance(entry, dict) else {}

    def _see_output(self, module, inputs, output) -> None:
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if module.training and loss is not None and self.driver is not None:
            self.driver.saw_loss(loss)

    # -- each step ---------------------------------------------------------------------------
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        """Add the stage's penalty to the accumulated gradients."""
        self.driver.before_optimizer_step()

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        """The controller's bookkeeping; the late stage starts after ``late_start`` steps."""
        self.driver.after_optimizer_step(state.global_step + 1, optimizer)

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Add the objective, size, compressions, total rank and stage to ``Trainer``'s log."""
        if self.driver is None or logs is None or "loss" not in logs:
            return
        extra = self.driver.log_values(float(logs["loss"]))
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)

    def on_train_end(self, args, state, control, **kwargs):
        """Remove the loss hook; warn when the run ended short of its target."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = ()
        self.end_training(state.global_step)

    # -- checkpoints ---------------------------------------------------------------------------
    def on_save(self, args, state, control, model=None, **kwargs):
        """Mark each TT layer in the checkpoint's weights (HuggingFace's loader then refuses it)."""
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir() and model is not None:
            mark_checkpoint(folder, [name for name, _ in gated_layers(model)])

    def state(self) -> dict[str, Any]:
        """What ``trainer_state.json`` keeps: the schedule and the controller's state."""
        controller = None if self.driver is None else self.driver.controller.state_dict()
        return {"args": self.schedule.settings(),
                "attributes": {"controller_state": controller}}


class ComeraSavePretrained:
    """A model's ``save_pretrained`` that writes comera's files too (see
    :func:`saves_comera_files_`): HuggingFace's own files, each TT layer marked in its weights,
    then :func:`comera.save_pretrained`'s files in the same folder."""

    def __init__(self, model: Any):
        self.model = model

    def __call__(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        """HuggingFace's ``save_pretrained(save_directory, ...)``, then the marks and comera's
        files."""
        result = type(self.model).save_pretrained(self.model, save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            mark_checkpoint(save_directory, [name for name, _ in gated_layers(self.model)])
            save_pretrained(self.model, save_directory)
        return result


def saves_comera_files_(model: Any) -> None:
    """Make ``model.save_pretrained`` (which ``Trainer.save_model`` and its checkpoints call)
    write a folder :func:`comera.from_pretrained` reads and HuggingFace's own
    ``from_pretrained`` refuses (a size mismatch naming each TT layer), instead of one HF would
    load as dense layers with fresh random weights. HuggingFace's files stay, so
    ``resume_from_checkpoint`` reads them as before. A model without ``save_pretrained`` is left
    as it is (Trainer then saves its state dict, and :meth:`CoMERACallback.on_save` marks it)."""
    if callable(getattr(type(model), "save_pretrained", None)) and not isinstance(
            model.__dict__.get("save_pretrained"), ComeraSavePretrained):
        model.save_pretrained = ComeraSavePretrained(model)


# the weights HuggingFace's save_pretrained writes (safetensors, or a .bin from transformers 4.x
# with save_safetensors=False; ``.<variant>`` before the extension with variant=...), whole or
# as shards listed by an index
HF_WEIGHTS = re.compile(r"(model(\.[^.]+)?\.safetensors|pytorch_model(\.[^.]+)?\.bin)")
HF_INDEX = re.compile(r"(model\.safetensors|pytorch_model\.bin)\.index(\.[^.]+)?\.json")


def _weights_files(folder: str | os.PathLike) -> list[tuple[Path, Path | None]]:
    """Each set of weights HuggingFace wrote in ``folder``: ``(file, None)`` for a whole file,
    ``(first shard, index)`` for a sharded one (comera's own files are not among them)."""
    folder = Path(folder)
    found: list[tuple[Path, Path | None]] = []
    for path in sorted(folder.iterdir()):
        if HF_INDEX.fullmatch(path.name):
            shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
            if shards:
                found.append((folder / shards[0], path))
        elif HF_WEIGHTS.fullmatch(path.name):
            found.append((path, None))
    return [(target, index) for target, index in found if target.is_file()]


def mark_checkpoint(folder: str | os.PathLike, layers: list[str]) -> None:
    """Add a zero-size ``<layer>.weight`` for each TT layer to every set of weights HuggingFace
    wrote in ``folder`` (:func:`_weights_files`: safetensors or .bin, any variant, sharded or
    not), so HuggingFace's ``from_pretrained`` refuses the folder (a size mismatch) rather than
    re-initialising those layers; ``resume_from_checkpoint`` drops them again
    (:mod:`comera.integrations.bonds`)."""
    if not layers:
        return
    for target, index in _weights_files(folder):
        _add_markers(target, layers)
        if index is not None:  # sharded: the markers went into the first shard
            record = json.loads(index.read_text())
            for name in layers:
                record["weight_map"].setdefault(f"{name}.{SENTINEL}", target.name)
            atomic_write_text(index, json.dumps(record, indent=2))


def _add_markers(target: Path, layers: list[str]) -> None:
    """The weights file ``target`` with a zero-size ``<layer>.weight`` for each of ``layers``."""
    import torch

    if target.suffix == ".bin":  # a torch.save of the state dict
        tensors = read_torch_file(target)
        for name in layers:
            tensors.setdefault(f"{name}.{SENTINEL}", torch.empty(0))
        write_torch_file(target, tensors)
        return
    import safetensors.torch
    from safetensors import safe_open

    with safe_open(str(target), framework="pt") as f:
        metadata = f.metadata() or {"format": "pt"}
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iter)
    for name in layers:
        tensors.setdefault(f"{name}.{SENTINEL}", torch.empty(0))
    atomic_write_bytes(target, safetensors.torch.save(tensors, metadata=metadata))
