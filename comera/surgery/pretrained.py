"""Save and load converted models as a folder, PEFT-style: save_pretrained, from_pretrained.

    comera.save_pretrained(model, "out/tt-bert")          # a converted (and truncated) model
    model = comera.from_pretrained("out/tt-bert", BertForSequenceClassification)

The folder holds ``comera_model.safetensors`` (every tensor of the model; tensors shared by tied
modules stored once), ``comera_layers.json`` (per TT layer its kind, modes, bonds, tau, bias,
padding_idx and merge setting; the tied-tensor aliases; a sha256 over tensors and records) and,
for a HuggingFace model, its ``config.json``. ``from_pretrained`` builds the model (from the class
and that config, or takes a model you built), converts the recorded layers at the recorded modes,
resizes them to the recorded bonds and loads every tensor: the result equals the saved model.

HuggingFace's own ``from_pretrained`` cannot read this folder: there is no ``model.safetensors``
(it raises ``OSError`` rather than returning a dense model with freshly random layers, which is
what it does with the files of HF's ``save_pretrained`` of a converted model).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from comera.errors import CheckpointError
from comera.layers.linear import GatedTrain
from comera.ranks.size import tt_modules
from comera.surgery import checkpoint as _ckpt
from comera.surgery.convert import HF_SAVE_WARNING, ConvertConfig, convert_
from tncomp.files import atomic_write_bytes, atomic_write_text

WEIGHTS = "comera_model.safetensors"
HF_CONFIG = "config.json"
RECORDS = "comera_layers.json"
FORMAT = "comera-pretrained"
VERSION = 1

PathLike = str | os.PathLike


def _safetensors():
    try:
        import safetensors.torch
    except ImportError as exc:
        raise ImportError("save_pretrained / from_pretrained need safetensors: pip install "
                          "'tncomp[hf]' (or pip install safetensors).") from exc
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
    st = _safetensors()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors, aliases = _deduplicated(model.state_dict())
    layers = {name: _ckpt.layer_spec(layer) for name, layer in tt_modules(model)}
    every = {**tensors, **{a: tensors[t] for a, t in aliases.items()}}
    payload = _ckpt.checkpoint_payload(dict(sorted(every.items())), layers)
    records = {"format": FORMAT, "version": VERSION,
               "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
               "layers": layers, "aliases": aliases, "checksum": payload["checksum"]}
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):  # a HuggingFace model
        # what HF's config.save_pretrained writes, but atomically and never through a link
        atomic_write_text(directory / HF_CONFIG, config.to_json_string(use_diff=True))
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
        records = json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); the folder is damaged.") from exc
    if records.get("format") != FORMAT or records.get("version") != VERSION:
        raise CheckpointError(f"{path} is not a {FORMAT} version {VERSION} record (format="
                              f"{records.get('format')!r}, version={records.get('version')!r}).")
    return records


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


def _convert_like_(model: nn.Module, layers: dict[str, dict]) -> None:
    """Convert the still dense modules of ``model`` that the records hold as TT layers, at the
    recorded modes (rank 1: the weights are loaded afterwards)."""
    groups: dict[tuple, dict[str, tuple]] = {}
    for name, spec in layers.items():
        try:
            if isinstance(model.get_submodule(name), GatedTrain):
                continue
            target = name
        except AttributeError:  # a projection of a (dense) nn.MultiheadAttention
            target = name.rpartition(".")[0]
            if not isinstance(_get(model, target), nn.MultiheadAttention):
                continue  # load_checkpoint names what is missing
        packed = f"{target}.in_proj" in layers
        fmt = "ttm" if spec["kind"] == "TTMLinear" else "tt"
        key = (fmt, spec["kind"] == "TTEmbedding", packed)
        groups.setdefault(key, {})[name] = (spec["in_modes"], spec["out_modes"])
        groups[key].setdefault(target, (spec["in_modes"], spec["out_modes"]))
    for (fmt, embedding, packed), modes in groups.items():
        with warnings.catch_warnings():  # loading is how HF_SAVE_WARNING's advice is followed
            warnings.filterwarnings("ignore", message=re.escape(HF_SAVE_WARNING[:40]))
            convert_(model, ConvertConfig(include=tuple(modes), linear=not embedding,
                                          embedding=embedding, ranks=1, format=fmt,
                                          modes=modes,
                                          attention_in_proj="packed" if packed else "split"))
    for name, spec in layers.items():
        module = _get(model, name)
        if spec.get("merge_pairs") is not None and module is not None:
            module.merge_pairs = bool(spec["merge_pairs"])


def _get(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def from_pretrained(directory: PathLike, model_or_class: nn.Module | type) -> nn.Module:
    """The model saved by :func:`save_pretrained` in ``directory``, with its TT layers at the
    saved ranks. ``model_or_class``: a model of the saved architecture (converted or not; it is
    changed in place), or its class (a HuggingFace class is built from the saved config and put
    in eval mode, as HuggingFace's ``from_pretrained`` does)."""
    directory = Path(directory)
    records = _read_records(directory)
    model = _build(model_or_class, directory)
    st = _safetensors()
    try:
        tensors = st.load_file(directory / WEIGHTS)
    except Exception as exc:
        raise CheckpointError(f"{directory / WEIGHTS} cannot be read ({type(exc).__name__}: "
                              f"{exc}); the folder is damaged.") from exc
    tensors.update({alias: tensors[name] for alias, name in records["aliases"].items()})
    payload = _ckpt.checkpoint_payload(dict(sorted(tensors.items())), records["layers"])
    payload["checksum"] = records["checksum"]  # the stored one: read_checkpoint verifies it
    _ckpt.read_checkpoint(payload)  # before the model is changed
    _convert_like_(model, records["layers"])
    _ckpt.load_checkpoint(payload, model)
    return model


__all__ = ["from_pretrained", "save_pretrained"]
