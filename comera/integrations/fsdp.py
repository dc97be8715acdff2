"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with rank gates: the replicated-TT policy.

    model = build()                                    # same seed on every worker
    comera.convert_(model, ranks=16)
    policy = shard_(model)                             # dense parts sharded, TT layers replicated
    opt = comera.make_optimizer(model)
    trainer = comera.CoMERATrainer(model, opt, grad_hook=gradient_hook(max_grad_norm=1.0))
    loss = ...; trainer.step(loss, decision_loss=mean_over_workers(float(loss)))
    save_checkpoint(path, model, opt, trainer=trainer.state_dict())   # every worker calls it

The policy: every parameter of a TT layer (cores, gates, its bias) is passed to ``fully_shard``
as an ignored parameter, so it stays a plain, full tensor on every worker; everything else
(embeddings left dense, norms, heads) is sharded by FSDP2 in units of the model's blocks. After
backward FSDP2 has reduce-scattered (averaged) the sharded gradients, and
:func:`average_replicated_gradients` all-reduces (averages) the replicated ones (and
:func:`gradient_hook` clips by the global norm, which torch's clipping cannot compute over
mixed sharded and replicated gradients), so every worker
applies the same update to the same full cores and gates. Hence every gate decision (the masks,
the regulariser, the size, pruning, the late stage's choice, truncation) reads the full gates and
agrees on all workers without a message, and truncation, which replaces TT parameters by smaller
ones, touches no sharded parameter: nothing is re-sharded. What it costs: the TT layers'
parameters and optimizer state are held whole by every worker, which for a CoMERA model is the
small part (its cores are the compressed weights); the dense remainder is what gets sharded.

Checkpoints are the single-file comera format (:func:`comera.save_checkpoint`'s): the sharded
parameters and optimizer state are gathered whole (``full_state_dict``) and worker 0 writes the
file; :func:`load_checkpoint` loads it into a sharded model (resizing truncated TT layers, which
are replicated, and scattering the rest), and :func:`comera.load_checkpoint` into an unsharded
one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from comera.errors import CheckpointError, ConfigError
from comera.integrations.collectives import average_over_workers_
from comera.ranks.size import gated_layers
from comera.surgery.checkpoint import checkpoint_payload, read_checkpoint
from comera.surgery.records import layer_spec
from comera.surgery.swap import check_other_keys, match_layers, restore_layers_
from comera.torchfile import write_torch_file

__all__ = ["FSDPPolicy", "average_replicated_gradients", "clip_grad_norm_", "gradient_hook",
           "load_checkpoint", "save_checkpoint", "shard_"]


@dataclass(frozen=True)
class FSDPPolicy:
    """What :func:`shard_` did: the modules sharded (qualified names, the root last) and the
    number of parameters kept replicated (the TT layers') and sharded."""

    units: tuple[str, ...]
    replicated: int
    sharded: int


def _is_dtensor(t: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the policy keeps whole on every worker: every TT layer's."""
    seen: dict[int, nn.Parameter] = {}
    for _, layer in gated_layers(model):
        for p in layer.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def default_units(model: nn.Module) -> list[str]:
    """The blocks to shard one by one: the entries of every top-most ``nn.ModuleList`` (a
    transformer's layers) that hold parameters outside TT layers."""
    tt = {id(p) for p in replicated_parameters(model)}
    units: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or any(name.startswith(u + ".") for u in units):
            continue
        for i, block in enumerate(module):
            if any(id(p) not in tt for p in block.parameters()):
                units.append(f"{name}.{i}" if name else str(i))
    return units


def shard_(model: nn.Module, units: Iterable[str] | None = None,
           reshard_after_forward: bool = True) -> FSDPPolicy:
    """Apply ``fully_shard`` to ``units`` (qualified module names; default
    :func:`default_units`) and to ``model``, with every TT layer's parameters ignored (kept
    replicated, see the module docstring). Needs an initialised process group."""
    from torch.distributed.fsdp import fully_shard

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("shard_ needs an initialised process group (torchrun, or "
                          "torch.distributed.init_process_group) before fully_shard.")
    ignored = set(replicated_parameters(model))
    names = list(default_units(model) if units is None else units)
    modules = dict(model.named_modules())
    missing = [n for n in names if n not in modules]
    if missing:
        raise ConfigError(f"units {missing} are not modules of the model; give qualified names "
                          f"such as {list(modules)[1:4]}.")
    for name in names:
        fully_shard(modules[name], reshard_after_forward=reshard_after_forward,
                    ignored_params=ignored)
    fully_shard(model, reshard_after_forward=reshard_after_forward, ignored_params=ignored)
    sharded = sum(p.numel() for p in model.parameters() if _is_dtensor(p))
    return FSDPPolicy((*names, ""), sum(p.numel() for p in ignored), sharded)


def average_replicated_gradients(model: nn.Module) -> None:
    """Average the gradients FSDP does not reduce (the replicated, non-DTensor ones) over the
    workers, one flat ``all_reduce`` per dtype: the trainer's ``grad_hook`` under FSDP."""
    average_over_workers_(p.grad for p in model.parameters()
                          if p.grad is not None and not _is_dtensor(p))


def clip_grad_norm_(model: nn.Module, max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over a model holding both sharded (DTensor) and
    replicated gradients, which torch's own refuses to mix: the squared norms of the local
    shards are summed over the workers, the replicated ones counted once, and every gradient is
    scaled by ``min(1, max_norm / (norm + 1e-6))``. Returns the total norm (float64)."""
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for g in grads:
        if _is_dtensor(g):
            sharded += g.to_local().detach().double().square().sum().cpu()
        else:
            replicated += g.detach().double().square().sum().cpu()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sharded, op=dist.ReduceOp.SUM)
    total = (sharded + replicated).sqrt()
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    if coef < 1.0:
        with torch.no_grad():
            for g in grads:
                (g.to_local() if _is_dtensor(g) else g).mul_(coef)
    return total


def gradient_hook(max_grad_norm: float | None = None) -> Callable[[nn.Module], None]:
    """The trainer's ``grad_hook`` under this policy: average the replicated gradients, then,
    with ``max_grad_norm``, clip by the global norm (:func:`clip_grad_norm_`). Give the trainer
    ``max_grad_norm=None`` then: its own clipping cannot mix sharded and replicated gradients."""
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ConfigError(f"max_grad_norm={max_grad_norm}; give a norm > 0 (or None).")

    def hook(model: nn.Module) -> None:
        average_replicated_gradients(model)
        if max_grad_norm is not None:
            clip_grad_norm_(model, max_grad_norm)

    return hook


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def save_checkpoint(path: str | Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, **extra: Any) -> None:
    """Gather the sharded state whole and write one comera checkpoint from worker 0 (a
    collective: every worker calls it). The file loads with :func:`comera.load_checkpoint`."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = _full_options()
    state = get_model_state_dict(model, options=options)
    full = (get_optimizer_state_dict(model, optimizer, options=options)
            if optimizer is not None else None)  # whole on worker 0, empty on the others
    if dist.get_rank() == 0:
        record = None if full is None else _indexed_record(full, type(optimizer).__name__)
        layers = {name: layer_spec(layer) for name, layer in gated_layers(model)}
        path = Path(path)
        if not path.parent.is_dir():
            raise CheckpointError(f"cannot save {path}: the directory {path.parent} does not "
                                  "exist; create it first.")
        write_torch_file(path, checkpoint_payload(state, layers, record, extra))
    dist.barrier()


def _indexed_record(full: dict[str, Any], class_name: str) -> dict[str, Any]:
    """A name-keyed optimizer state (``get_optimizer_state_dict``) in the comera record format:
    ``optimizer.state_dict()``'s index keys plus each group's parameter names."""
    index: dict[str, int] = {}
    groups, names = [], []
    for group in full["param_groups"]:
        ids = []
        for name in group["params"]:
            index.setdefault(name, len(index))
            ids.append(index[name])
        groups.append({**group, "params": ids})
        names.append(list(group["params"]))
    state = {index[name]: value for name, value in full["state"].items()}
    return {"optimizer": {"state": state, "param_groups": groups}, "optimizer_class": class_name,
            "optimizer_param_names": names}


def load_checkpoint(path: str | Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load a comera checkpoint into a sharded ``model`` (every worker calls it with the same
    file): TT layers are resized to the saved bonds and loaded whole (they are replicated),
    the sharded entries are scattered from the full ones, and ``optimizer``'s groups are rebuilt
    by parameter name and its state loaded, each worker keeping its shard. Returns ``extra``."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    record = read_checkpoint(path)
    where = record.path
    plan = match_layers(model, record.layers, where)
    layers = [name for name, _, _ in plan]
    if any(not name for name in layers):
        raise CheckpointError(f"{where}: the model itself is a TT layer; shard a parent module.")
    check_other_keys(model, record.model, layers, True, where)
    if optimizer is not None and (record.optimizer is None
                                  or record.optimizer_class != type(optimizer).__name__):
        raise CheckpointError(f"{where} holds {record.optimizer_class or 'no'} optimizer state; "
                              f"loading it needs a {type(optimizer).__name__}'s.")
    restore_layers_(model, plan)

    def inside(key: str) -> bool:
        return any(key.startswith(name + ".") for name in layers)

    mine = model.state_dict()
    with torch.no_grad():
        for key, value in record.model.items():
            if inside(key):
                mine[key].copy_(value)
    rest = {k: v for k, v in record.model.items() if not inside(k)}
    set_model_state_dict(model, rest, options=StateDictOptions(full_state_dict=True,
                                                               strict=False))
    if optimizer is not None:
        params = dict(model.named_parameters())
        names = record.optimizer_param_names
        saved = record.optimizer
        optimizer.param_groups = [
            {**{k: v for k, v in group.items() if k != "params"},
             "params": [params[n] for n in group_names]}
            for group, group_names in zip(saved["param_groups"], names, strict=True)]
        optimizer.state.clear()
        by_index = [n for group_names in names for n in group_names]
        state = {by_index[i]: value for i, value in saved["state"].items()}
        groups = [{**g, "params": list(group_names)}
                  for g, group_names in zip(saved["param_groups"], names, strict=True)]
        set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups},
                                 options=StateDictOptions(full_state_dict=True))
    return dict(record.extra)
