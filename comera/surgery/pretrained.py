"""Save and load converted models as a folder, PEFT-style: save_pretrained, from_pretrained.

    comera.save_pretrained(model, "out/tt-bert")          # a converted (and truncated) model
    model = comera.from_pretrained("out/tt-bert", BertForSequenceClassification)

The folder holds ``comera_model.safetensors`` (every tensor of the model; tensors shared by tied
modules stored once), ``comera_layers.json`` (per gated layer its record,
:mod:`comera.surgery.records`: format, layout, tau, bias; the tied-tensor aliases; a sha256 over
tensors, records and ``config.json``) and, for a HuggingFace model, its ``config.json``.
Records read back are checked (types, ranges, layouts, shapes against the tensors present)
before anything is built, so an edited folder raises :class:`~comera.errors.CheckpointError`,
never a raw error or a huge allocation. ``from_pretrained`` builds the model (from the class and
that config, or takes a model you built), converts the recorded layers to the recorded formats
and modes (:func:`~comera.surgery.checkpoint.load_checkpoint` does it all, and undoes it when the
load fails), resizes them to the recorded bonds and loads every tensor: the result equals the
saved model.

HuggingFace's own ``from_pretrained`` cannot read this folder: there is no ``model.safetensors``
(it raises ``OSError`` rather than returning a dense model with freshly random layers, which is
what it does with the files of HF's ``save_pretrained`` of a converted model).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from comera.errors import CheckpointError, ConfigError
from comera.ranks.size import gated_layers
from comera.surgery import checkpoint as _ckpt
from comera.surgery.records import layer_spec
from comera.surgery.swap import check_module
from tncomp.files import atomic_write_bytes, atomic_write_text, link_or_special

WEIGHTS = "comera_model.safetensors"
HF_CONFIG = "config.json"
RECORDS = "comera_layers.json"
FORMAT = "comera-pretrained"
VERSION = 3  # 2: the checksum covers HF's config.json too; 3: layer records of any format
READS = (1, 2, 3)  # version 1 folders load, with a warning that config.json is not covered
MAX_RECORDS_BYTES = 64 * 2**20  # a records or config file larger than this is not ours

PathLike = str | os.PathLike


def _safetensors():
    try:
        import safetensors.torch
    except ImportError as exc:
        raise ImportError("save_pretrained / from_pretrained need safetensors: pip install -e "
                          "'.[hf]' in the comera checkout (or pip install safetensors).") from exc
    return safetensors.torch


def _deduplicated(state: dict[str, torch.Tensor]):
    """Tensors with tied (same storage and view) entries stored once, and the aliases."""
    first: dict[tuple, str] = {}
    tensors, aliases = {}, {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()), t.dtype)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
            tensors[name] = t.detach().contiguous()
    return tensors, aliases


def save_pretrained(model: nn.Module, directory: PathLike) -> Path:
    """Write ``model`` (converted, truncated or not) to ``directory``; return its path."""
    check_module(model, "save_pretrained(model, directory)")
    if not isinstance(directory, str | os.PathLike):
        raise ConfigError(f"save_pretrained: directory is a {type(directory).__name__}, not a "
                          "folder name; the arguments are save_pretrained(model, directory).")
    st = _safetensors()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors, aliases = _deduplicated(model.state_dict())
    layers = {name: layer_spec(layer) for name, layer in gated_layers(model)}
    every = {**tensors, **{a: tensors[t] for a, t in aliases.items()}}
    config = getattr(model, "config", None)
    config_bytes = None
    if config is not None and hasattr(config, "to_json_string"):  # a HuggingFace model
        # what HF's config.save_pretrained writes, but atomically and never through a link
        config_bytes = config.to_json_string(use_diff=True).encode()
    covered = {"config_sha256": _sha256(config_bytes) if config_bytes is not None else None}
    payload = _ckpt.checkpoint_payload(dict(sorted(every.items())), layers, extra=covered)
    records = {"format": FORMAT, "version": VERSION,
               "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
               "layers": layers, "aliases": aliases, **covered,
               "checksum": payload["checksum"]}
    if config_bytes is not None:
        atomic_write_bytes(directory / HF_CONFIG, config_bytes)
    atomic_write_bytes(directory / WEIGHTS, st.save({k: v.cpu() for k, v in tensors.items()},
                                                    metadata={"format": "pt",
                                                              "producer": FORMAT}))
    atomic_write_text(directory / RECORDS, json.dumps(records, indent=1))
    return directory


def _read_records(directory: Path) -> dict[str, Any]:
    path = directory / RECORDS
    if not path.is_file() or not (directory / WEIGHTS).is_file():
        hint = (" It holds a config.json and no comera files: was it written by HuggingFace's "
                "save_pretrained? That does not keep TT layers; save with "
                "comera.save_pretrained(model, dir).") if (directory / "config.json").is_file() \
            else ""
        raise CheckpointError(f"{directory} lacks {RECORDS} or {WEIGHTS}; it was not written by "
                              f"comera.save_pretrained.{hint}")
    try:
        records = json.loads(_read_bytes(path))
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); the folder is damaged.") from exc
    if not isinstance(records, dict) or records.get("format") != FORMAT \
            or records.get("version") not in READS:
        got = ((records.get("format"), records.get("version")) if isinstance(records, dict)
               else type(records).__name__)
        raise CheckpointError(f"{path} is not a {FORMAT} record of version "
                              f"{' or '.join(map(str, READS))} (got {got!r}).")
    if not isinstance(records.get("layers"), dict):
        raise CheckpointError(f"{path}: its layers are not a mapping of names to records; the "
                              "folder is damaged or was edited.")
    aliases = records.get("aliases")
    if not isinstance(aliases, dict) or not all(
            isinstance(a, str) and isinstance(t, str) for a, t in aliases.items()):
        raise CheckpointError(f"{path}: its aliases are not a mapping of names to names; the "
                              "folder is damaged or was edited.")
    if not isinstance(records.get("checksum"), str):
        raise CheckpointError(f"{path} lacks its checksum; the folder is damaged or was edited.")
    digest = records.get("config_sha256")
    if records["version"] >= 2 and not (digest is None or isinstance(digest, str)):
        raise CheckpointError(f"{path}: its config_sha256 is a {type(digest).__name__}; the "
                              "folder is damaged or was edited.")
    return records


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_bytes(path: Path) -> bytes:
    """A small regular file of the folder, read without following a link (a link, a FIFO or
    a device planted there is refused: it could hang the read or point anywhere)."""
    found = link_or_special(path)
    if found is not None:
        raise CheckpointError(f"{path} is {found}; a saved folder holds regular files only.")
    if path.stat().st_size > MAX_RECORDS_BYTES:
        raise CheckpointError(f"{path} is {path.stat().st_size} bytes, more than a record "
                              "holds; the folder is damaged or was edited.")
    return path.read_bytes()


def _covered(records: dict[str, Any], directory: Path) -> dict[str, Any]:
    """The ``extra`` the checksum covers: the sha256 of config.json, which must match the file
    (version 1 folders predate it: a warning says config.json is not checked)."""
    config = directory / HF_CONFIG
    if records["version"] < 2:
        if config.exists():
            warnings.warn(f"{directory} was saved by an older comera: its {HF_CONFIG} is not "
                          "covered by the checksum. Save it again to cover it.", stacklevel=3)
        return {}
    digest = records.get("config_sha256")
    if digest is None:
        return {"config_sha256": None}
    if not config.exists():
        raise CheckpointError(f"{directory} lacks {HF_CONFIG}, which it was saved with; the "
                              "folder is damaged.")
    found = _sha256(_read_bytes(config))
    if found != digest:
        raise CheckpointError(f"{config} changed after the folder was saved (sha256 "
                              f"{found[:16]}..., recorded {digest[:16]}...): its settings "
                              "would change what the model computes. Use another copy of the "
                              "folder, or save the model again.")
    return {"config_sha256": digest}


def _build(model_or_class: nn.Module | type, directory: Path) -> nn.Module:
    if isinstance(model_or_class, nn.Module):
        return model_or_class
    if isinstance(model_or_class, type) and issubclass(model_or_class, nn.Module):
        config_class = getattr(model_or_class, "config_class", None)
        if config_class is not None:  # HuggingFace: the class and the saved config.json
            model = model_or_class(config_class.from_pretrained(directory))
            return model.eval()
        return model_or_class()
    raise CheckpointError(f"from_pretrained takes a model or an nn.Module class, got "
                          f"{model_or_class!r}.")


def from_pretrained(directory: PathLike, model_or_class: nn.Module | type) -> nn.Module:
    """The model saved by :func:`save_pretrained` in ``directory``, with its gated layers at
    the saved formats and ranks. ``model_or_class``: a model of the saved architecture
    (converted or not; it is changed in place, and left as it was when the load fails), or its
    class (a HuggingFace class is built from the saved config and put in eval mode, as
    HuggingFace's ``from_pretrained`` does)."""
    if not isinstance(directory, str | os.PathLike):
        raise ConfigError(f"from_pretrained: directory is a {type(directory).__name__}, not a "
                          "folder name; the arguments are from_pretrained(directory, "
                          "model_or_class).")
    directory = Path(directory)
    records = _read_records(directory)
    extra = _covered(records, directory)  # before config.json is read to build the model
    st = _safetensors()
    weights = directory / WEIGHTS
    found = link_or_special(weights)
    if found is not None:
        raise CheckpointError(f"{weights} is {found}; a saved folder holds regular files only.")
    try:
        tensors = st.load_file(weights)
    except Exception as exc:
        raise CheckpointError(f"{weights} cannot be read ({type(exc).__name__}: "
                              f"{exc}); the folder is damaged.") from exc
    missing = sorted(t for t in records["aliases"].values() if t not in tensors)
    if missing:
        raise CheckpointError(f"{directory / RECORDS} names tied tensors that {WEIGHTS} lacks "
                              f"({', '.join(missing[:5])}); the folder is damaged or was edited.")
    tensors.update({alias: tensors[name] for alias, name in records["aliases"].items()})
    payload = _ckpt.checkpoint_payload(dict(sorted(tensors.items())), records.get("layers"),
                                       extra=extra)
    payload["checksum"] = records["checksum"]  # the stored one: read_checkpoint verifies it
    _ckpt.read_checkpoint(payload)  # checksum and records, before a model is built
    model = _build(model_or_class, directory)
    # converts a dense Conv1D / attention first; a failure leaves the model as it was
    _ckpt.load_checkpoint(payload, model)
    return model


__all__ = ["from_pretrained", "save_pretrained"]
