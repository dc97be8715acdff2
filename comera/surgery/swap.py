"""Model surgery: record a TT layer, rebuild it from its record, and swap submodules by name.

A truncated TT layer's cores are smaller than a freshly built one's, so restoring saved weights
first reshapes the target model: every recorded layer is matched by its dotted name, a TT layer
of other bonds is resized in place, and an unconverted ``nn.Linear`` / ``nn.Embedding`` is
replaced by the recorded TT layer. :func:`match_layers` checks the whole model before
:func:`restore_layers_` changes anything. :func:`swap_submodule` is the one place a submodule is
replaced by name (``convert_`` and checkpoint loading both use it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from comera.errors import CheckpointError, ConfigError
from comera.layers.embedding import TTEmbedding
from comera.layers.linear import GatedTrain, TTLinear, TTMLinear

KINDS: dict[str, type[GatedTrain]] = {
    "TTEmbedding": TTEmbedding, "TTMLinear": TTMLinear, "TTLinear": TTLinear}

LayerPlan = list[tuple[str, nn.Module, Mapping[str, Any]]]  # (name, module now, record)
SPEC_KEYS = ("kind", "in_features", "out_features", "in_modes", "out_modes", "bonds", "tau",
             "bias", "padding_idx", "merge_pairs")
MAX_FEATURES = 2**31 - 1  # a record's sizes and bonds: int32, checked before anything is built
MAX_MODES = 64


def swap_submodule(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at the dotted ``name`` inside ``model`` (e.g. ``"encoder.0.fc1"``) and return
    the module it replaces."""
    if not name:
        raise ConfigError("swap_submodule got the empty name, i.e. the model itself; a module "
                          "can only be swapped inside a parent (wrap it in an nn.Module).")
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    setattr(parent, child, new)
    return old


# -- records --------------------------------------------------------------------------------------
def layer_kind(layer: GatedTrain) -> str:
    """The record name of ``layer``'s type (a key of :data:`KINDS`)."""
    for name, cls in KINDS.items():
        if isinstance(layer, cls):
            return name
    raise CheckpointError(f"layer type {type(layer).__name__} is a GatedTrain that checkpoints "
                          f"do not know; expected one of {', '.join(KINDS)}.")


def layer_spec(layer: GatedTrain) -> dict[str, Any]:
    """What it takes to rebuild ``layer`` with its current (physical) shapes."""
    return {
        "kind": layer_kind(layer),
        "in_features": int(layer.in_features),
        "out_features": int(layer.out_features),
        "in_modes": tuple(int(m) for m in layer.in_modes),
        "out_modes": tuple(int(m) for m in layer.out_modes),
        "bonds": tuple(layer.bonds),
        "tau": float(layer.tau),
        "bias": layer.bias is not None,
        "padding_idx": getattr(layer, "padding_idx", None),
        "merge_pairs": getattr(layer, "merge_pairs", None),
    }


def build_layer(spec: Mapping[str, Any], like: Tensor) -> GatedTrain:
    """The TT layer a :func:`layer_spec` record describes, with the recorded bonds and tau, on
    ``like``'s dtype and device (weights uninitialised: load them next)."""
    factory = {"dtype": like.dtype, "device": like.device}
    bonds = list(spec["bonds"])
    if spec["kind"] == "TTEmbedding":
        layer: GatedTrain = TTEmbedding(
            spec["in_features"], spec["out_features"], spec["in_modes"], spec["out_modes"],
            bonds, spec["padding_idx"], spec["tau"], merge_pairs=bool(spec["merge_pairs"]),
            **factory)
    else:
        cls = KINDS[spec["kind"]]
        layer = cls(spec["in_features"], spec["out_features"], spec["in_modes"],
                    spec["out_modes"], bonds, spec["bias"], spec["tau"], **factory)
    layer.tau = float(spec["tau"])
    return layer


def resize_(module: GatedTrain, bonds: tuple[int, ...]) -> None:
    """Give ``module`` cores and gates of ``bonds`` (new uninitialised Parameters where the
    shape differs; load the weights next)."""
    for k, old in enumerate(module.cores):
        shape = (bonds[k], *old.shape[1:-1], bonds[k + 1])
        if tuple(old.shape) != shape:
            module.cores[k] = nn.Parameter(old.new_empty(shape), requires_grad=old.requires_grad)
    for k, gate in enumerate(module.gates):
        if gate.numel() != bonds[k + 1]:
            module.gates[k] = nn.Parameter(gate.new_ones(bonds[k + 1]),
                                           requires_grad=gate.requires_grad)
    module.build_compiled()


# -- checking a record read from a file ----------------------------------------------------------
def _whole(value: Any, low: int = 1, high: int = MAX_FEATURES) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _modes(value: Any) -> bool:
    return (isinstance(value, list | tuple) and 1 <= len(value) <= MAX_MODES
            and all(_whole(m) for m in value))


def _record_problem(spec: Any) -> str | None:
    """What is wrong with a record's types and ranges (None when nothing is)."""
    if not isinstance(spec, Mapping):
        return f"is a {type(spec).__name__}, not a mapping"
    missing = [k for k in SPEC_KEYS if k not in spec]
    if missing:
        return f"lacks {', '.join(missing)}"
    if spec["kind"] not in KINDS:
        return f"has kind {spec['kind']!r}; expected one of {', '.join(KINDS)}"
    for key in ("in_features", "out_features"):
        if not _whole(spec[key]):
            return f"has {key}={spec[key]!r}; expected a whole number in [1, {MAX_FEATURES}]"
    for key in ("in_modes", "out_modes", "bonds"):
        if not _modes(spec[key]):
            return (f"has {key}={spec[key]!r}; expected 1 to {MAX_MODES} whole numbers in "
                    f"[1, {MAX_FEATURES}]")
    tau = spec["tau"]
    if isinstance(tau, bool) or not isinstance(tau, int | float) or not math.isfinite(tau):
        return f"has tau={tau!r}; expected a finite number"
    if not isinstance(spec["bias"], bool):
        return f"has bias={spec['bias']!r}; expected true or false"
    if spec["padding_idx"] is not None and not _whole(spec["padding_idx"], -MAX_FEATURES):
        return f"has padding_idx={spec['padding_idx']!r}; expected null or a whole number"
    if spec["merge_pairs"] is not None and not isinstance(spec["merge_pairs"], bool):
        return f"has merge_pairs={spec['merge_pairs']!r}; expected null, true or false"
    return None


def check_records(layers: Any, state: Mapping[str, Any], where: str) -> None:
    """Refuse, before anything is built or allocated, TT layer records (read from a file) that
    do not describe a valid layer or whose shapes differ from the tensors the file holds: each
    record's types and ranges are checked, the layer it describes is built on the meta device
    (no memory) and every one of its tensors must be in ``state`` with the same shape. A
    :class:`CheckpointError` names the layer and what is wrong."""
    if not isinstance(layers, Mapping) or not all(isinstance(n, str) for n in layers):
        raise CheckpointError(f"{where}: the TT layer records are not a mapping of names to "
                              "records; the file is damaged or was edited.")
    for name, spec in layers.items():
        def refuse(why: str, name: str = name) -> CheckpointError:
            return CheckpointError(f"{where}: the record of TT layer {name or '<model>'} {why}; "
                                   "the file is damaged or was edited.")

        why = _record_problem(spec)
        if why is not None:
            raise refuse(why)
        try:
            meta = build_layer(spec, torch.empty(0, device="meta"))
        except (ValueError, TypeError, RuntimeError, OverflowError, IndexError) as exc:
            raise refuse(f"describes no valid layer ({type(exc).__name__}: {exc})") from None
        if tuple(meta.bonds) != tuple(spec["bonds"]):
            raise refuse(f"has bonds {tuple(spec['bonds'])}; its modes allow "
                         f"{tuple(meta.bonds)}")
        for key, expected in meta.state_dict().items():
            full = f"{name}.{key}" if name else key
            got = state.get(full)
            if not isinstance(got, Tensor):
                raise refuse(f"needs the tensor {full}, which the file lacks")
            if tuple(got.shape) != tuple(expected.shape):
                raise refuse(f"gives {full} the shape {tuple(expected.shape)}, but the file "
                             f"holds {tuple(got.shape)}")


# -- matching a model against records ------------------------------------------------------------
def _check_tt(module: GatedTrain, spec: Mapping[str, Any]) -> str | None:
    """Why ``module`` cannot hold the recorded layer ``spec`` (None when it can)."""
    kind = layer_kind(module)
    if kind != spec["kind"]:
        return f"the model has a {kind}, the checkpoint a {spec['kind']}"
    mine = (module.in_features, module.out_features, tuple(module.in_modes),
            tuple(module.out_modes))
    theirs = (spec["in_features"], spec["out_features"], tuple(spec["in_modes"]),
              tuple(spec["out_modes"]))
    if mine != theirs:
        return f"(in, out, in_modes, out_modes) are {mine} in the model, {theirs} in the checkpoint"
    if len(spec["bonds"]) != len(module.bonds):
        return f"the model has bonds {module.bonds}, the checkpoint {tuple(spec['bonds'])}"
    if (module.bias is not None) != spec["bias"]:
        return f"bias={module.bias is not None} in the model, {spec['bias']} in the checkpoint"
    if getattr(module, "padding_idx", None) != spec["padding_idx"]:
        return (f"padding_idx={getattr(module, 'padding_idx', None)} in the model, "
                f"{spec['padding_idx']} in the checkpoint")
    return None


def _check_plain_module(module: nn.Module, spec: Mapping[str, Any]) -> str | None:
    """Why the unconverted ``module`` cannot be replaced by the recorded layer (None if it can)."""
    if isinstance(module, nn.Linear):
        if spec["kind"] == "TTEmbedding":
            return "the model has an nn.Linear, the checkpoint a TTEmbedding"
        mine = (module.in_features, module.out_features, module.bias is not None)
    elif isinstance(module, nn.Embedding):
        if spec["kind"] != "TTEmbedding":
            return f"the model has an nn.Embedding, the checkpoint a {spec['kind']}"
        if module.padding_idx != spec["padding_idx"]:
            return (f"padding_idx={module.padding_idx} in the model, {spec['padding_idx']} in "
                    "the checkpoint")
        mine = (module.num_embeddings, module.embedding_dim, spec["bias"])
    else:
        return (f"the model has a {type(module).__name__}; expected a TT layer, nn.Linear or "
                "nn.Embedding")
    theirs = (spec["in_features"], spec["out_features"], spec["bias"])
    if mine != theirs:
        return f"(in, out, bias) are {mine} in the model, {theirs} in the checkpoint"
    return None


def match_layers(model: nn.Module, layers: Mapping[str, Mapping[str, Any]],
                 where: str) -> LayerPlan:
    """Check every recorded layer against ``model`` (nothing is changed); return the
    (name, module, record) triples for :func:`restore_layers_`. ``where`` names the source in
    errors."""
    missing, problems, plan = [], [], []
    for name, spec in layers.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            missing.append(name)
            continue
        if isinstance(module, GatedTrain):
            why = _check_tt(module, spec)
        else:
            why = _check_plain_module(module, spec)
            if why is None and not name:
                why = "the model itself is the unconverted layer; wrap it in a parent module"
        if why is not None:
            problems.append(f"{name or '<model>'}: {why}")
        plan.append((name, module, spec))
    if missing:
        raise CheckpointError(
            f"{where} records TT layers that the model lacks: {', '.join(missing)}. Load it into "
            "a model of the same architecture (converted or not)."
        )
    if problems:
        raise CheckpointError(f"{where} does not match the model: " + "; ".join(problems) + ".")
    return plan


def check_other_keys(model: nn.Module, state: Mapping[str, Tensor], layer_names: list[str],
                     strict: bool, where: str) -> None:
    """Shapes (and, if strict, key sets) of the state entries outside the recorded TT layers."""

    def outside(key: str) -> bool:
        return not any(not n or key.startswith(n + ".") for n in layer_names)

    mine = {k: v for k, v in model.state_dict().items() if outside(k)}
    theirs = {k: v for k, v in state.items() if outside(k)}
    bad = [f"{k}: {tuple(theirs[k].shape)} in the checkpoint, {tuple(v.shape)} in the model"
           for k, v in mine.items()
           if k in theirs and isinstance(v, Tensor) and isinstance(theirs[k], Tensor)
           and v.shape != theirs[k].shape]
    if strict:
        bad += [f"{k}: missing from the checkpoint" for k in mine if k not in theirs]
        bad += [f"{k}: not in the model" for k in theirs if k not in mine]
    if bad:
        raise CheckpointError(f"{where} does not match the model outside its TT layers: "
                              + "; ".join(bad[:10]) + (" ..." if len(bad) > 10 else "")
                              + ". Use the same architecture (or strict=False for missing or "
                              "extra entries).")


def restore_layers_(model: nn.Module, plan: LayerPlan) -> None:
    """Reshape ``model`` to the records of a :func:`match_layers` plan: resize each TT layer
    (and restore its tau), replace each unconverted layer by the recorded TT layer."""
    for name, module, spec in plan:
        if isinstance(module, GatedTrain):
            resize_(module, tuple(spec["bonds"]))
            module.tau = float(spec["tau"])
        else:
            swap_submodule(model, name, build_layer(spec, module.weight))


__all__ = ["KINDS", "build_layer", "check_other_keys", "check_records", "layer_kind", "layer_spec",
           "match_layers", "resize_", "restore_layers_", "swap_submodule"]
