"""Model surgery: swap submodules by name, and reshape a model to layer records.

A truncated gated layer's cores are smaller than a freshly built one's, so restoring saved
weights first reshapes the target model: every recorded layer (:mod:`comera.surgery.records`)
is matched by its dotted name, a gated layer of other bond sizes is resized in place
(``GatedLayer.resize_bonds_``: every bond, in every core that carries it; :func:`match_layers`
has checked the layouts agree up to bond sizes), and an unconverted ``nn.Linear`` /
``nn.Embedding`` is replaced by the recorded layer. :func:`match_layers` checks the whole model
before :func:`restore_layers_` changes anything. :func:`swap_submodule` is the one place a
submodule is replaced by name (``convert_`` and checkpoint loading both use it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from comera.errors import CheckpointError, ConfigError
from comera.formats.layout import Layout
from comera.layers.attention import TTMultiheadAttention
from comera.layers.linear import GatedLayer
from comera.surgery.records import KINDS, build_layer, kind_of

LayerPlan = list[tuple[str, nn.Module, Mapping[str, Any]]]  # (name, module now, record)


def check_module(value: Any, usage: str, what: str = "model") -> None:
    """Refuse, with a :class:`ConfigError` naming the call's argument order, a ``what`` that is
    not an ``nn.Module`` (swapped arguments, say ``save_checkpoint(model, path)``), before
    anything reads or writes. ``usage``: the call as it should be written."""
    if not isinstance(value, nn.Module):
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ConfigError(f"{usage.partition('(')[0]}: {what} is a {type(value).__name__} "
                          f"({shown}), not an nn.Module; the arguments are {usage}.")


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


def fast_paths_off_(model: nn.Module) -> None:
    """Switch off torch's transformer fast paths where they would read a dense weight that a
    gated layer replaced (``convert_`` and loading a checkpoint into a dense model both swap)."""
    def converted(module: nn.Module) -> bool:
        return any(isinstance(m, GatedLayer | TTMultiheadAttention) for m in module.modules())

    for module in model.modules():
        if isinstance(module, nn.TransformerEncoderLayer) and converted(module):
            module.activation_relu_or_gelu = 0  # the fast path requires relu/gelu flagged
        elif isinstance(module, nn.TransformerEncoder) and converted(module):
            module.use_nested_tensor = False


_TABLES = ("_modules", "_parameters", "_buffers")  # nn.Module's own dicts: restored in place


@contextlib.contextmanager
def restored_on_error(model: nn.Module) -> Iterator[None]:
    """Undo, when the block raises, every swap and attribute change made inside it to
    ``model``'s modules: each module's submodules, parameters, buffers and attributes are put
    back as they were (the same objects; nothing is copied, so it costs no memory). Values
    written in place into a tensor are not undone: check before loading weights."""
    saved = []
    for module in model.modules():
        state = {k: (dict(v) if k in _TABLES else v) for k, v in module.__dict__.items()}
        saved.append((module, state))
    try:
        yield
    except BaseException:
        for module, state in saved:
            for key in [k for k in module.__dict__ if k not in state]:
                del module.__dict__[key]
            for key, value in state.items():
                if key in _TABLES:
                    table = module.__dict__[key]
                    table.clear()
                    table.update(value)
                else:
                    module.__dict__[key] = value
        raise


# -- matching a model against records ------------------------------------------------------------
def _describe(layout: Layout) -> str:
    return (f"in_modes {layout.in_modes}, out_modes {layout.out_modes}, cores "
            f"{[list(c) for c in layout.cores]}")


def _check_gated(module: GatedLayer, spec: Mapping[str, Any]) -> str | None:
    """Why the gated ``module`` cannot take the recorded layer ``spec`` (None when it can):
    the same kind, format, layout up to its bond sizes, bias and padding."""
    theirs = build_layer(spec, torch.empty(0, device="meta"))
    if kind_of(module).name != spec["kind"]:
        return (f"the model has a {type(module).__name__} (format {module.format.name}), the "
                f"checkpoint a {spec['kind']} (format {theirs.format.name})")
    if module.format.name != theirs.format.name:
        return (f"the model's layer has format {module.format.name}, the checkpoint's "
                f"{theirs.format.name}")
    mine, want = module.layout, theirs.layout
    if len(mine.bonds) != len(want.bonds) or \
            mine.resized(dict(zip(mine.bonds, want.bond_sizes, strict=True))) != want:
        return f"the model's layer has {_describe(mine)}, the checkpoint's {_describe(want)}"
    if (module.bias is not None) != (theirs.bias is not None):
        return (f"bias={module.bias is not None} in the model, {theirs.bias is not None} in "
                "the checkpoint")
    if getattr(module, "padding_idx", None) != getattr(theirs, "padding_idx", None):
        return (f"padding_idx={getattr(module, 'padding_idx', None)} in the model, "
                f"{getattr(theirs, 'padding_idx', None)} in the checkpoint")
    return None


def _check_plain_module(module: nn.Module, spec: Mapping[str, Any]) -> str | None:
    """Why the unconverted ``module`` cannot be replaced by the recorded layer (None if it can)."""
    kind = KINDS[spec["kind"]]
    if not isinstance(module, kind.dense):
        dense = sorted({k.dense.__name__ for k in KINDS.values()})
        return (f"the model has a {type(module).__name__}, the checkpoint a {spec['kind']} "
                f"(which takes the place of an nn.{kind.dense.__name__}); expected a gated layer "
                f"or one of nn.{', nn.'.join(dense)}")
    return kind.fits(module, spec)


def match_layers(model: nn.Module, layers: Mapping[str, Mapping[str, Any]],
                 where: str) -> LayerPlan:
    """Check every recorded layer (records as :func:`~comera.surgery.records.read_records`
    returns them) against ``model`` (nothing is changed); return the (name, module, record)
    triples for :func:`restore_layers_`. ``where`` names the source in errors."""
    missing, problems, plan = [], [], []
    for name, spec in layers.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            missing.append(name)
            continue
        if isinstance(module, GatedLayer):
            why = _check_gated(module, spec)
        else:
            why = _check_plain_module(module, spec)
            if why is None and not name:
                why = "the model itself is the unconverted layer; wrap it in a parent module"
        if why is not None:
            problems.append((name or "<model>", why))
        plan.append((name, module, spec))
    if missing:
        raise CheckpointError(
            f"{where} records gated layers that the model lacks: {', '.join(missing[:6])}"
            f"{f' and {len(missing) - 6} more' if len(missing) > 6 else ''}. Load it "
            "into a model of the same architecture (converted or not)."
        )
    if problems:
        raise CheckpointError(f"{where} does not match the model: {_grouped(problems)}.")
    return plan


def _grouped(problems: list[tuple[str, str]], names: int = 3, most: int = 4) -> str:
    """``(layer, why)`` pairs as one short text: the layers sharing a reason listed once with
    it (a model of twelve blocks has one reason twelve times), at most ``most`` reasons."""
    by_why: dict[str, list[str]] = {}
    for name, why in problems:
        by_why.setdefault(why, []).append(name)
    parts = []
    for why, layers in list(by_why.items())[:most]:
        shown = ", ".join(layers[:names])
        more = f" and {len(layers) - names} more" if len(layers) > names else ""
        parts.append(f"{shown}{more}: {why}")
    if len(by_why) > most:
        parts.append(f"and {len(by_why) - most} other differences")
    return "; ".join(parts)


def check_other_keys(model: nn.Module, state: Mapping[str, Tensor], layer_names: list[str],
                     strict: bool, where: str) -> None:
    """Shapes (and, if strict, key sets) of the state entries outside the recorded layers."""

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
        raise CheckpointError(f"{where} does not match the model outside its gated layers: "
                              + "; ".join(bad[:10]) + (" ..." if len(bad) > 10 else "")
                              + ". Use the same architecture (or strict=False for missing or "
                              "extra entries).")


def restore_layers_(model: nn.Module, plan: LayerPlan) -> None:
    """Reshape ``model`` to the records of a :func:`match_layers` plan: resize each gated layer
    to the recorded bond sizes (and restore its tau), replace each unconverted layer by the
    recorded one."""
    for name, module, spec in plan:
        if isinstance(module, GatedLayer):
            module.resize_bonds_(build_layer(spec, torch.empty(0, device="meta")).bond_sizes)
            module.tau = float(spec["tau"])
        else:
            swap_submodule(model, name, build_layer(spec, module.weight))
    fast_paths_off_(model)


__all__ = ["check_module", "check_other_keys", "fast_paths_off_", "match_layers",
           "restore_layers_", "restored_on_error", "swap_submodule"]
