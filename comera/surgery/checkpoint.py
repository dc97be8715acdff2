"""Checkpoints of rank-adaptive models: save once, load into a truncated, untruncated or
unconverted model with one call.

A truncated model's cores are smaller than the ones a freshly built model has, so a plain
``load_state_dict`` fails on the shapes. The checkpoint therefore records, per gated layer, its
format and layout at the stored bond sizes (:mod:`comera.surgery.records`); ``load_checkpoint``
resizes each gated layer of the target model to the recorded bonds (or, where the target still
holds the ``nn.Linear`` / ``nn.Embedding`` it was converted from, builds the recorded layer in
its place; a HuggingFace ``Conv1D`` or an ``nn.MultiheadAttention`` is converted first, as
``convert_`` would) before loading the weights (the surgery lives in
:mod:`comera.surgery.swap`). A load that fails leaves the model as it was: every swap is undone
(:func:`~comera.surgery.swap.restored_on_error`), and every check runs before a weight is
written.

    comera.save_checkpoint("run.pt", model, optimizer, step=1200)
    extra = comera.load_checkpoint("run.pt", fresh_model, optimizer)   # extra == {"step": 1200}
    record = comera.read_checkpoint("run.pt")                          # the contents, no model

Optimizer: pass the optimizer built over ``model`` (before or after the call, e.g. with
``make_optimizer(model)``, of the same class as the saved one). ``load_checkpoint`` rebuilds its
param groups from the checkpoint, by parameter name, over the model's parameters *after* loading,
then loads the saved state (moments, steps, learning rates) into it (see
:mod:`comera.training.optimizer_state`). The object is changed in place, so a ``CoMERATrainer``
holding it keeps working.

The file is written atomically (``tncomp.files.atomic_write_bytes``: a temp file in the same
directory, then a rename); temp files that a killed writer left behind are swept on a later save
or load. It carries a sha256 over the model state, the layer records, the optimizer state and
``extra``. The checksum sits in the same file, so it detects accidental damage (a truncated copy,
a disk or transfer error), not deliberate edits: whoever can write the file can recompute it.
A file that is truncated, corrupt, not a comera checkpoint or whose checksum does not match
raises :class:`~comera.errors.CheckpointError`. Files are read with
``torch.load(weights_only=True)``, so a checkpoint cannot run code, but it can hold any weights:
load checkpoints only from places you trust. ``extra`` must therefore be plain data (numbers,
strings, tensors, lists, tuples, dicts); it is covered by the checksum too (a resumed run trusts
the step, RNG and scheduler state it holds).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from comera.errors import CheckpointError, ComeraError, ConfigError
from comera.formats.registry import get_format
from comera.layers.linear import GatedLayer
from comera.ranks.size import gated_layers
from comera.surgery.config import ConvertConfig
from comera.surgery.convert import HF_SAVE_WARNING, convert_
from comera.surgery.records import KINDS, build_layer, layer_spec, read_records
from comera.surgery.swap import (
    check_module,
    check_other_keys,
    match_layers,
    restore_layers_,
    restored_on_error,
)
from comera.torchfile import (
    load_error_reason,
    read_torch_file,
    refused_global,
    update_digest,
    write_torch_file,
)
from comera.training.optimizer_state import check_optimizer, optimizer_record, rebuild_optimizer_
from tncomp.files import sweep_temp_files

log = logging.getLogger("comera.surgery.checkpoint")

FORMAT = "comera-checkpoint"
VERSION = 3  # 2: the checksum covers ``extra``; 3: layer records of any format (records.py)
READS = (2, 3)  # version 2 records (TTLinear / TTMLinear kinds) are read as today's
STALE_TEMP_S = 600.0  # a checkpoint temp file this old belongs to a writer that died mid-write
LEGACY_TEMP_SUFFIX = ".tmp"  # what checkpoint temp files ended in before tncomp.files
_PLAIN = (type(None), bool, int, float, complex, str, bytes, Tensor, torch.dtype, torch.device,
          torch.Size)

PathLike = str | os.PathLike
# the raw errors an edited record can raise while loading: each becomes a CheckpointError
_RAW = (KeyError, AttributeError, TypeError, ValueError, IndexError, RuntimeError)


@dataclass(frozen=True)
class CheckpointRecord:
    """What a comera checkpoint holds, read and checksum-verified: the model's state dict, a
    :func:`~comera.surgery.records.layer_spec` record per gated layer (by dotted name; records
    of older versions upgraded to today's kinds), the optimizer
    state (``None`` when saved without one) and the ``extra`` data."""

    path: str  # where it was read from
    model: dict[str, Tensor]
    layers: dict[str, dict[str, Any]]
    extra: dict[str, Any]
    optimizer: dict[str, Any] | None
    optimizer_class: str | None
    optimizer_param_names: list[list[str]] | None
    version: int


# -- checksum and plain data ----------------------------------------------------------------------
def _checksum(payload: Mapping[str, Any]) -> str:
    h = hashlib.sha256()
    for key in ("model", "layers", "optimizer", "optimizer_param_names", "extra"):
        update_digest(h, payload.get(key))
    return h.hexdigest()


def _check_plain(obj: Any, where: str) -> None:
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            if not isinstance(key, str | int):
                raise CheckpointError(f"{where} has the key {key!r}; keys of extra data are str "
                                      "or int.")
            _check_plain(value, f"{where}[{key!r}]")
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            _check_plain(value, f"{where}[{i}]")
    elif not isinstance(obj, _PLAIN):
        raise CheckpointError(
            f"{where} is a {type(obj).__name__}; extra data must be plain (numbers, strings, "
            "tensors, lists, tuples, dicts) so the file loads with weights_only=True. Convert it "
            "first, e.g. dataclasses.asdict(config)."
        )


def _check_arguments(path: Any, optimizer: Any, usage: str) -> None:
    """A file name (str or os.PathLike) and an optimizer (or None), else a
    :class:`ConfigError` naming the call's argument order."""
    call = usage.partition("(")[0]
    if not isinstance(path, str | os.PathLike):
        raise ConfigError(f"{call}: path is a {type(path).__name__}, not a file name (str or "
                          f"pathlib.Path); the arguments are {usage}.")
    if optimizer is not None and not hasattr(optimizer, "param_groups"):
        raise ConfigError(f"{call}: optimizer is a {type(optimizer).__name__}, not a "
                          f"torch.optim.Optimizer; the arguments are {usage}.")


def _sweep(path: Path) -> None:
    """Remove the temp files of earlier writes of ``path`` whose writers died."""
    try:
        sweep_temp_files(path.parent, prefix=f".{path.name}.", older_than_s=STALE_TEMP_S)
        # checkpoints written before tncomp.files existed left ".NAME.HEX.tmp"
        sweep_temp_files(path.parent, prefix=f".{path.name}.", older_than_s=STALE_TEMP_S,
                         suffix=LEGACY_TEMP_SUFFIX)
    except OSError as exc:  # e.g. a read-only folder: the sweep must not block a load
        log.warning("could not sweep stale temp files of %s (%s)", path, exc)


# -- save -----------------------------------------------------------------------------------------
def checkpoint_payload(model_state: Mapping[str, Tensor], layers: Mapping[str, Any],
                       optimizer: Mapping[str, Any] | None = None,
                       extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The checkpoint format as a dict (what :func:`save_checkpoint` writes and
    :func:`read_checkpoint` / :func:`load_checkpoint` accept): a model state dict, layer
    records (:func:`comera.surgery.records.layer_spec`), an optimizer record, ``extra``, and
    their checksum."""
    payload: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "model": model_state, "layers": dict(layers),
        "optimizer": None, "optimizer_class": None, "optimizer_param_names": None,
        "extra": dict(extra or {}),
    }
    payload.update(optimizer or {})
    payload["checksum"] = _checksum(payload)
    return payload


def save_checkpoint(path: PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, **extra: Any) -> None:
    """Write model, layer records, optimizer state and ``extra`` to ``path``, atomically."""
    usage = "save_checkpoint(path, model, optimizer=None, **extra)"
    check_module(model, usage)
    _check_arguments(path, optimizer, usage)
    _check_plain(extra, "extra")
    layers = {name: layer_spec(layer) for name, layer in gated_layers(model)}
    payload = checkpoint_payload(
        model.state_dict(), layers,
        optimizer_record(model, optimizer) if optimizer is not None else None, extra)
    path = Path(path)
    if not path.parent.is_dir():
        raise CheckpointError(f"cannot save {path}: the directory {path.parent} does not exist; "
                              "create it first.")
    _sweep(path)
    try:
        write_torch_file(path, payload)
    except OSError as exc:
        raise CheckpointError(f"cannot save {path}: {exc}.") from exc


# -- read -----------------------------------------------------------------------------------------
def _load_file(where: str) -> Any:
    if not Path(where).is_file():
        raise CheckpointError(f"checkpoint {where} does not exist (or is not a file).")
    try:
        return read_torch_file(where)
    except Exception as exc:
        found = refused_global(exc)
        if found:
            raise CheckpointError(
                f"{where} is not a comera checkpoint: it holds pickled Python objects ({found}), "
                "e.g. a whole model saved with torch.save(model); they are not unpickled, as "
                "that could run code. Write checkpoints with comera.save_checkpoint."
            ) from None
        raise CheckpointError(
            f"checkpoint {where} cannot be read: the file is truncated, corrupt or not a "
            f"torch file ({load_error_reason(exc)}). Re-save it with comera.save_checkpoint."
        ) from exc


def _read(source: PathLike | Mapping[str, Any]) -> CheckpointRecord:
    if isinstance(source, Mapping):
        payload, where = dict(source), "the checkpoint dict"
    else:
        where = str(source)
        payload = _load_file(where)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        got = (f"a dict with keys {sorted(map(str, payload))[:8]}" if isinstance(payload, dict)
               else f"a {type(payload).__name__}")
        raise CheckpointError(f"{where} is not a comera checkpoint: expected a dict with "
                              f"format={FORMAT!r}, got {got}. Write checkpoints with "
                              "comera.save_checkpoint.")
    version = payload.get("version")
    if version not in READS:
        raise CheckpointError(f"{where} has checkpoint version {version!r}; this comera reads "
                              f"versions {' and '.join(map(str, READS))}. Load it with the "
                              "comera that wrote it.")
    for key in ("model", "layers", "checksum", "extra"):
        if key not in payload:
            raise CheckpointError(f"{where} lacks the entry {key!r}; the file is damaged.")
    expected = _checksum(payload)
    if payload["checksum"] != expected:
        raise CheckpointError(f"{where} fails its checksum (stored {str(payload['checksum'])[:16]}"
                              f"..., computed {expected[:16]}...): its contents changed after "
                              "it was saved (a damaged or truncated copy, or an edit). Use "
                              "another copy of the checkpoint.")
    layers = _check_contents(payload, where)
    return CheckpointRecord(
        where, payload["model"], layers, payload["extra"], payload.get("optimizer"),
        payload.get("optimizer_class"), payload.get("optimizer_param_names"), version)


def _check_contents(payload: Mapping[str, Any], where: str) -> dict[str, dict]:
    """Types and sizes of a checksummed payload (whoever can write the file can recompute the
    checksum): a state dict of tensors, layer records that match those tensors, plain
    ``extra``, optimizer entries of the right kinds. Raises CheckpointError, before anything
    is built or allocated; returns the layer records, upgraded to today's kinds."""
    model = payload["model"]
    if not isinstance(model, Mapping) or not all(
            isinstance(k, str) and isinstance(v, Tensor) for k, v in model.items()):
        raise CheckpointError(f"{where}: its model entry is not a state dict of named tensors; "
                              "the file is damaged or was edited.")
    layers = read_records(payload["layers"], model, where)
    if not isinstance(payload["extra"], Mapping):
        raise CheckpointError(f"{where}: its extra entry is a {type(payload['extra']).__name__}, "
                              "not a mapping; the file is damaged or was edited.")
    for key, kinds in (("optimizer", Mapping), ("optimizer_class", str),
                       ("optimizer_param_names", list)):
        value = payload.get(key)
        if value is not None and not isinstance(value, kinds):
            raise CheckpointError(f"{where}: its {key} entry is a {type(value).__name__}; the "
                                  "file is damaged or was edited.")
    names = payload.get("optimizer_param_names")
    if names is not None and not all(
            isinstance(group, list) and all(isinstance(n, str) for n in group) for group in names):
        raise CheckpointError(f"{where}: its optimizer_param_names are not lists of names; the "
                              "file is damaged or was edited.")
    return layers


def read_checkpoint(source: PathLike | Mapping[str, Any]) -> CheckpointRecord:
    """The contents of a comera checkpoint (a path, or the dict torch.load returned), checked
    and checksum-verified, without a model to load them into."""
    return _read(source)


# -- load -----------------------------------------------------------------------------------------
def _pattern(name: str) -> str:
    """``name`` as an fnmatch pattern matching only itself."""
    return re.sub(r"([*?[])", r"[\1]", name)


def _get(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _convert_like_(model: nn.Module, layers: Mapping[str, Mapping]) -> None:
    """Convert the still dense modules of ``model`` that the records (checked and upgraded,
    :func:`~comera.surgery.records.read_records`) hold as gated layers and that loading cannot
    replace by itself (a dense nn.MultiheadAttention's projections, HF's Conv1D), each to its
    recorded format and modes (rank 1: they are resized and loaded afterwards). A plain
    ``nn.Linear`` / ``nn.Embedding`` is left to loading, which puts the recorded layer in its
    place (a format a conversion makes; a declared einsum layer must be in the model
    already)."""
    groups: dict[tuple[str, bool], dict[str, tuple[str, tuple | None]]] = {}
    targets: dict[tuple[str, bool], set[str]] = {}
    for name, spec in layers.items():
        owner = name.rpartition(".")[0]
        if isinstance(_get(model, owner), nn.MultiheadAttention):
            target = owner  # a projection of a dense attention: converted with it
        elif isinstance(_get(model, name), nn.Module) and not isinstance(
                _get(model, name), GatedLayer | KINDS[spec["kind"]].dense):
            target = name
        else:
            continue  # converted already, or missing: match_layers names what is missing
        layer = build_layer(spec, torch.empty(0, device="meta"))
        fmt, layout = layer.format.name, layer.layout
        modes = (layout.in_modes, layout.out_modes) if get_format(fmt).uses_modes else None
        key = (KINDS[spec["kind"]].switch, f"{target}.in_proj" in layers)
        groups.setdefault(key, {})[name] = (fmt, modes)
        targets.setdefault(key, set()).add(target)
    for (switch, packed), entries in groups.items():
        with warnings.catch_warnings():  # loading is how HF_SAVE_WARNING's advice is followed
            warnings.filterwarnings("ignore", message=re.escape(HF_SAVE_WARNING[:40]))
            convert_(model, ConvertConfig(
                include=tuple(_pattern(t) for t in sorted(targets[(switch, packed)])),
                linear=switch == "linear", embedding=switch == "embedding", ranks=1,
                format={_pattern(n): fmt for n, (fmt, _) in entries.items()},
                modes={n: modes for n, (_, modes) in entries.items() if modes is not None},
                attention_in_proj="packed" if packed else "split"))
    for name, spec in layers.items():
        module = _get(model, name)
        if spec.get("merge_pairs") is not None and module is not None:
            module.merge_pairs = bool(spec["merge_pairs"])


def _reshape_(model: nn.Module, record: CheckpointRecord, strict: bool) -> list:
    """Convert, check and reshape ``model`` to the record's layers (the caller undoes it all
    on an error); return the :func:`match_layers` plan."""
    where = record.path
    try:
        _convert_like_(model, record.layers)
    except CheckpointError:
        raise
    except ComeraError as exc:  # e.g. the recorded modes do not fit this model's Conv1D
        raise CheckpointError(f"{where} does not fit the {type(model).__name__}: {exc} It was "
                              "saved from another architecture, or was edited; the model is "
                              "unchanged.") from None
    except _RAW as exc:
        raise CheckpointError(f"{where} could not be loaded into the {type(model).__name__} "
                              f"({type(exc).__name__}: {exc}); it was saved from another "
                              "architecture, or was edited; the model is unchanged.") from None
    plan = match_layers(model, record.layers, where)
    check_other_keys(model, record.model, [name for name, _, _ in plan], strict, where)
    return plan


def load_checkpoint(source: PathLike | Mapping[str, Any], model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    strict: bool = True) -> dict[str, Any]:
    """Load ``source`` (a path, or the dict torch.load returned) into ``model``; return ``extra``.

    Each recorded layer is matched by name: a gated layer of other bonds is resized in place, an
    unconverted ``nn.Linear`` / ``nn.Embedding`` is replaced by the recorded layer (of a format
    a conversion makes; a declared einsum layer the model lacks is refused, naming it); its
    gate threshold tau is restored. The model is checked against the checkpoint before any
    weight is written.
    ``strict`` applies to the entries outside the gated layers (as in ``load_state_dict``). With
    ``optimizer``, its param groups are rebuilt over the loaded model and the saved state is
    loaded into it (see the module docstring). A HuggingFace ``Conv1D`` or an
    ``nn.MultiheadAttention`` the records hold as gated layers is converted first (the model may
    be the unconverted original). On a :class:`CheckpointError` before the optimizer is
    rebuilt, the model is as it was.
    """
    usage = "load_checkpoint(path, model, optimizer=None, strict=True)"
    check_module(model, usage)
    _check_arguments("the dict" if isinstance(source, Mapping) else source, optimizer, usage)
    if not isinstance(source, Mapping):
        _sweep(Path(source))
    record = _read(source)
    where = record.path
    with restored_on_error(model):  # every swap undone if anything below raises
        plan = _reshape_(model, record, strict)
        try:
            if optimizer is not None:
                check_optimizer(record.optimizer, record.optimizer_class, optimizer, where)
        except _RAW as exc:
            raise CheckpointError(f"{where}: its optimizer record cannot be read ("
                                  f"{type(exc).__name__}: {exc}); the file is damaged or was "
                                  "edited.") from None
        restore_layers_(model, plan)
        try:
            model.load_state_dict(record.model, strict=strict)
        except (RuntimeError, ConfigError) as exc:
            raise CheckpointError(f"{where} could not be loaded into the model (its layers are "
                                  "as they were, but weights outside them may be partly "
                                  f"overwritten; rebuild it before retrying): {exc}") from exc
    if optimizer is not None:
        try:
            rebuild_optimizer_(record.optimizer, record.optimizer_param_names, model, optimizer,
                               where)
        except CheckpointError:
            raise
        except _RAW as exc:  # an edited record that still passed its (recomputed) checksum
            raise CheckpointError(f"{where}: its optimizer state cannot be loaded ("
                                  f"{type(exc).__name__}: {exc}); the model was loaded, the "
                                  "optimizer was not. The file is damaged or was edited.") from None
    return dict(record.extra)


__all__ = ["CheckpointRecord", "layer_spec", "load_checkpoint", "read_checkpoint",
           "save_checkpoint"]
