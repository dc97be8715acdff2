"""An optimizer's state by parameter name: saved beside a model, rebuilt over a changed model.

``torch.optim.Optimizer.state_dict`` refers to parameters by position in its param groups. After
a checkpoint load replaced or resized layers, the positions belong to other tensor objects, so
the state is saved with the *names* of each group's parameters and, on load, the optimizer's
groups are rebuilt over the model's parameters of those names before the state goes in. The
optimizer object is changed in place, so a trainer holding it keeps working.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from comera.errors import CheckpointError


def _param_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def optimizer_record(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state with its class name and each group's parameter names in ``model``:
    the entries ``optimizer``, ``optimizer_class`` and ``optimizer_param_names``."""
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
    return {"optimizer": optimizer.state_dict(), "optimizer_class": type(optimizer).__name__,
            "optimizer_param_names": groups}


def check_optimizer(saved: Mapping[str, Any] | None, saved_class: str | None,
                    optimizer: torch.optim.Optimizer, where: str) -> None:
    """Refuse, before anything changes, a missing saved state or one of another optimizer class
    than ``optimizer``'s."""
    if saved is None:
        raise CheckpointError(f"{where} holds no optimizer state (it was saved without "
                              "optimizer=...); call load_checkpoint without an optimizer and "
                              "start a fresh one.")
    if saved_class != type(optimizer).__name__:
        raise CheckpointError(f"{where} holds the state of a {saved_class} optimizer, got a "
                              f"{type(optimizer).__name__}; pass an optimizer of the same class "
                              "(e.g. comera.make_optimizer(model) for AdamW).")


def rebuild_optimizer_(saved: Mapping[str, Any], names: list[list[str]], model: nn.Module,
                       optimizer: torch.optim.Optimizer, where: str) -> None:
    """Rebuild ``optimizer``'s groups over ``model``'s parameters of the saved ``names`` (one
    list per group), then load the ``saved`` state (moments, steps, learning rates) into it."""
    params = dict(model.named_parameters(remove_duplicate=False))
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


__all__ = ["check_optimizer", "optimizer_record", "rebuild_optimizer_"]
