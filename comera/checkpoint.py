"""Checkpoints of rank-adaptive TT models: save once, load into a truncated, untruncated or
unconverted model with one call.

A truncated model's cores are smaller than the ones a freshly built model has, so a plain
``load_state_dict`` fails on the shapes. The checkpoint therefore records, per TT layer, its type,
modes and physical bonds; ``load_checkpoint`` resizes each TT layer of the target model to the
recorded bonds (or, where the target still holds the ``nn.Linear`` / ``nn.Embedding`` it was
converted from, builds the recorded TT layer in its place) before loading the weights.

    comera.save_checkpoint("run.pt", model, optimizer, step=1200)
    extra = comera.load_checkpoint("run.pt", fresh_model, optimizer)   # extra == {"step": 1200}

Optimizer: pass the optimizer built over ``model`` (before or after the call, e.g. with
``make_optimizer(model)``, of the same class as the saved one). ``load_checkpoint`` rebuilds its
param groups from the checkpoint, by parameter name, over the model's parameters *after* loading,
then loads the saved state (moments, steps, learning rates) into it. The object is changed in
place, so a ``CoMERATrainer`` holding it keeps working.

The file is written atomically (a temporary file in the same directory, then ``os.replace``) and
carries a sha256 over the model state, the layer records and the optimizer state; a file that is
truncated, corrupt, not a comera checkpoint or whose checksum does not match raises
:class:`~comera.errors.CheckpointError`. ``extra`` must be plain data (numbers, strings, tensors,
lists, tuples, dicts), because files are read with ``torch.load(weights_only=True)``; it is
covered by the checksum too (a resumed run trusts the step, RNG and scheduler state it holds).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from comera.embedding import TTEmbedding
from comera.errors import CheckpointError
from comera.layers import GatedTrain, TTLinear, TTMLinear
from comera.size import tt_modules

FORMAT = "comera-checkpoint"
VERSION = 2  # 2: the checksum covers ``extra``
KINDS: dict[str, type[GatedTrain]] = {
    "TTEmbedding": TTEmbedding, "TTMLinear": TTMLinear, "TTLinear": TTLinear}
_PLAIN = (type(None), bool, int, float, complex, str, bytes, Tensor, torch.dtype, torch.device,
          torch.Size)

PathLike = str | os.PathLike


# -- records --------------------------------------------------------------------------------------
def _kind(layer: GatedTrain) -> str:
    for name, cls in KINDS.items():
        if isinstance(layer, cls):
            return name
    raise CheckpointError(f"layer type {type(layer).__name__} is a GatedTrain that checkpoints "
                          f"do not know; expected one of {', '.join(KINDS)}.")


def layer_spec(layer: GatedTrain) -> dict[str, Any]:
    """What it takes to rebuild ``layer`` with its current (physical) shapes."""
    return {
        "kind": _kind(layer),
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


def _update(h: Any, obj: Any) -> None:
    """Feed ``obj`` (nested dicts / lists / tensors / scalars) into the hash ``h``, in order."""
    if isinstance(obj, Tensor):
        t = obj.detach().to("cpu").contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(obj, Mapping):
        h.update(f"D{len(obj)}".encode())
        for key, value in obj.items():
            h.update(f"K{key!r}".encode())
            _update(h, value)
    elif isinstance(obj, list | tuple):
        h.update(f"L{len(obj)}".encode())
        for value in obj:
            _update(h, value)
    else:
        h.update(f"S{obj!r}".encode())


def _checksum(payload: Mapping[str, Any]) -> str:
    h = hashlib.sha256()
    for key in ("model", "layers", "optimizer", "optimizer_param_names", "extra"):
        _update(h, payload.get(key))
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


def _param_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


# -- save -----------------------------------------------------------------------------------------
def save_checkpoint(path: PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, **extra: Any) -> None:
    """Write model, TT layer records, optimizer state and ``extra`` to ``path``, atomically."""
    _check_plain(extra, "extra")
    layers = {name: layer_spec(layer) for name, layer in tt_modules(model)}
    payload: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "model": model.state_dict(), "layers": layers,
        "optimizer": None, "optimizer_class": None, "optimizer_param_names": None,
        "extra": dict(extra),
    }
    if optimizer is not None:
        names = _param_names(model)
        groups = []
        for i, group in enumerate(optimizer.param_groups):
            missing = [tuple(p.shape) for p in group["params"] if id(p) not in names]
            if missing:
                raise CheckpointError(
                    f"optimizer param group {i} holds {len(missing)} parameter(s) that are not in "
                    f"the model (shapes {missing[:4]}); build the optimizer over this model's "
                    "current parameters (after truncate_ / convert_, or pass the optimizer to "
                    "truncate_ so it follows)."
                )
            groups.append([names[id(p)] for p in group["params"]])
        payload["optimizer"] = optimizer.state_dict()
        payload["optimizer_class"] = type(optimizer).__name__
        payload["optimizer_param_names"] = groups
    payload["checksum"] = _checksum(payload)
    _atomic_save(payload, Path(path))


def _atomic_save(payload: dict[str, Any], path: Path) -> None:
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise CheckpointError(f"cannot save {path}: the directory {directory} does not exist; "
                              "create it first.")
    tmp = directory / f".{path.name}.{secrets.token_hex(6)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # honours the umask
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise CheckpointError(f"cannot save {path}: {exc}.") from exc
        raise


# -- load -----------------------------------------------------------------------------------------
def _read(source: PathLike | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    if isinstance(source, Mapping):
        payload, where = dict(source), "the checkpoint dict"
    else:
        where = str(source)
        if not Path(source).is_file():
            raise CheckpointError(f"checkpoint {where} does not exist (or is not a file).")
        try:
            payload = torch.load(source, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint {where} cannot be read: the file is truncated, corrupt or not a "
                f"torch file ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}). Re-save it "
                "with comera.save_checkpoint."
            ) from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        got = (f"a dict with keys {sorted(map(str, payload))[:8]}" if isinstance(payload, dict)
               else f"a {type(payload).__name__}")
        raise CheckpointError(f"{where} is not a comera checkpoint: expected a dict with "
                              f"format={FORMAT!r}, got {got}. Write checkpoints with "
                              "comera.save_checkpoint.")
    version = payload.get("version")
    if version != VERSION:
        raise CheckpointError(f"{where} has checkpoint version {version!r}; this comera reads "
                              f"version {VERSION}. Load it with the comera that wrote it.")
    for key in ("model", "layers", "checksum", "extra"):
        if key not in payload:
            raise CheckpointError(f"{where} lacks the entry {key!r}; the file is damaged.")
    expected = _checksum(payload)
    if payload["checksum"] != expected:
        raise CheckpointError(f"{where} fails its checksum (stored {str(payload['checksum'])[:16]}"
                              f"..., computed {expected[:16]}...): the weights were changed or "
                              "damaged after saving. Use another copy of the checkpoint.")
    return payload, where


def _core_shapes(module: GatedTrain, bonds: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [(bonds[k], *core.shape[1:-1], bonds[k + 1]) for k, core in enumerate(module.cores)]


def _check_tt(module: GatedTrain, spec: Mapping[str, Any]) -> str | None:
    """Why ``module`` cannot hold the recorded layer ``spec`` (None when it can)."""
    kind = _kind(module)
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


def _build(spec: Mapping[str, Any], like: Tensor) -> GatedTrain:
    """The recorded TT layer, with the recorded bonds, on ``like``'s dtype and device."""
    factory = {"dtype": like.dtype, "device": like.device}
    bonds = list(spec["bonds"])
    if spec["kind"] == "TTEmbedding":
        return TTEmbedding(spec["in_features"], spec["out_features"], spec["in_modes"],
                           spec["out_modes"], bonds, spec["padding_idx"], spec["tau"],
                           merge_pairs=bool(spec["merge_pairs"]), **factory)
    cls = KINDS[spec["kind"]]
    return cls(spec["in_features"], spec["out_features"], spec["in_modes"], spec["out_modes"],
               bonds, spec["bias"], spec["tau"], **factory)


def _resize_(module: GatedTrain, bonds: tuple[int, ...]) -> None:
    """Replace the cores and gates by new (uninitialised) Parameters of the recorded bonds."""
    for k, shape in enumerate(_core_shapes(module, bonds)):
        old = module.cores[k]
        if tuple(old.shape) != shape:
            module.cores[k] = nn.Parameter(old.new_empty(shape), requires_grad=old.requires_grad)
    for k, gate in enumerate(module.gates):
        if gate.numel() != bonds[k + 1]:
            module.gates[k] = nn.Parameter(gate.new_ones(bonds[k + 1]),
                                           requires_grad=gate.requires_grad)


def _plan_layers(model: nn.Module, layers: Mapping[str, Mapping[str, Any]], where: str):
    """Check every recorded layer against ``model``; return (name, module, spec) to act on."""
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


def _check_other_keys(model: nn.Module, state: Mapping[str, Tensor], layer_names: list[str],
                      strict: bool, where: str) -> None:
    """Shapes (and, if strict, key sets) of the entries outside the recorded TT layers."""

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


def load_checkpoint(source: PathLike | Mapping[str, Any], model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    strict: bool = True) -> dict[str, Any]:
    """Load ``source`` (a path, or the dict torch.load returned) into ``model``; return ``extra``.

    Each recorded TT layer is matched by name: a TT layer of other bonds is resized in place, an
    unconverted ``nn.Linear`` / ``nn.Embedding`` is replaced by the recorded TT layer; its gate
    threshold tau is restored. The model is checked against the checkpoint before it is changed.
    ``strict`` applies to the entries outside the TT layers (as in ``load_state_dict``). With
    ``optimizer``, its param groups are rebuilt over the loaded model and the saved state is
    loaded into it (see the module docstring).
    """
    payload, where = _read(source)
    state = payload["model"]
    plan = _plan_layers(model, payload["layers"], where)
    _check_other_keys(model, state, [name for name, _, _ in plan], strict, where)
    if optimizer is not None:
        _check_optimizer(payload, optimizer, where)
    for name, module, spec in plan:
        if isinstance(module, GatedTrain):
            _resize_(module, tuple(spec["bonds"]))
            module.tau = float(spec["tau"])
        else:
            like = module.weight
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, _build(spec, like))
    try:
        model.load_state_dict(state, strict=strict)
    except RuntimeError as exc:
        raise CheckpointError(f"{where} could not be loaded into the model (it was partly "
                              f"changed; rebuild it before retrying): {exc}") from exc
    if optimizer is not None:
        _load_optimizer(payload, model, optimizer, where)
    return dict(payload["extra"])


# -- optimizer ------------------------------------------------------------------------------------
def _check_optimizer(payload: Mapping[str, Any], optimizer: torch.optim.Optimizer,
                     where: str) -> None:
    if payload.get("optimizer") is None:
        raise CheckpointError(f"{where} holds no optimizer state (it was saved without "
                              "optimizer=...); call load_checkpoint without an optimizer and "
                              "start a fresh one.")
    saved = payload.get("optimizer_class")
    if saved != type(optimizer).__name__:
        raise CheckpointError(f"{where} holds the state of a {saved} optimizer, got a "
                              f"{type(optimizer).__name__}; pass an optimizer of the same class "
                              "(e.g. comera.make_optimizer(model) for AdamW).")


def _load_optimizer(payload: Mapping[str, Any], model: nn.Module,
                    optimizer: torch.optim.Optimizer, where: str) -> None:
    """Rebuild ``optimizer``'s groups over ``model``'s parameters by name, then load the state."""
    saved = payload["optimizer"]
    params = dict(model.named_parameters(remove_duplicate=False))
    names = payload["optimizer_param_names"]
    missing = [n for group in names for n in group if n not in params]
    if missing:
        raise CheckpointError(f"{where}: the optimizer state refers to parameters the model "
                              f"lacks: {', '.join(missing[:10])}. Use the same architecture.")
    groups, index = [], 0
    for group_names, saved_group in zip(names, saved["param_groups"], strict=True):
        group = {k: v for k, v in saved_group.items() if k != "params"}
        group["params"] = [params[n] for n in group_names]
        for name, p in zip(group_names, group["params"], strict=True):
            for key, value in saved["state"].get(index, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0 and value.shape != p.shape:
                    raise CheckpointError(
                        f"{where}: optimizer state {key!r} of {name} has shape "
                        f"{tuple(value.shape)}, the parameter {tuple(p.shape)}; the checkpoint "
                        "is inconsistent. Re-save it.")
            index += 1
        groups.append(group)
    optimizer.param_groups = groups
    optimizer.state.clear()
    try:
        optimizer.load_state_dict(saved)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"{where}: the optimizer state could not be loaded: {exc}") from exc


__all__ = ["layer_spec", "load_checkpoint", "save_checkpoint"]
