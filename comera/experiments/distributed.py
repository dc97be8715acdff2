"""Data parallelism for the training engine: one process per worker, gradients averaged.

Launched by ``torchrun`` (or ``comera train ... --nproc N``, which calls it): every worker builds
the same model from the same seed, takes its shard of each global batch, and after backward the
gradients are averaged with one flat ``all_reduce`` (gloo on CPU, NCCL on GPU). Every worker
therefore applies the same update, and every CoMERA decision (which gate entries are pruned, when
to truncate, loss-or-size in the late stage) is computed from identical values, so ranks and
shapes stay in lock-step without extra messages.

Why not ``DistributedDataParallel``: a late-stage "size" step and the rank regulariser produce
gradients outside the forward graph, and truncation changes parameter shapes mid-run. An
all-reduce after backward is exact for both and needs no re-wrapping; on CPU/gloo it loses
little, since DDP's overlap of communication with backward buys little there.

``--fsdp`` (:func:`prepare_model_`): FSDP2 shards the dense parts and keeps the TT layers
replicated (:mod:`comera.integrations.fsdp`), so the gate decisions still read identical, full
gates.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from comera import ConfigError
from comera.integrations.collectives import average_over_workers_
from comera.surgery.checkpoint import load_checkpoint as load_checkpoint_plain
from comera.surgery.checkpoint import save_checkpoint as save_checkpoint_plain


@dataclass(frozen=True)
class World:
    """This process's place among the data-parallel workers (rank 0 of 1 when alone)."""

    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def current_world() -> World:
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World()


def init_from_env(device: str = "cpu") -> World:
    """Join the process group ``torchrun`` describes in the environment (a no-op without it)."""
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return World()
    if not dist.is_available():
        raise ConfigError("WORLD_SIZE is set but this torch has no torch.distributed; "
                          "install a torch build with distributed support.")
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend)
    return current_world()


def broadcast_parameters_(model: nn.Module) -> None:
    """Make every worker start from rank 0's parameters and buffers."""
    world = current_world()
    if world.size == 1:
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


def average_gradients(model: nn.Module) -> None:
    """Average ``.grad`` over the workers in place (one flat all-reduce per dtype)."""
    # same on every worker: the same code ran on the same shapes, so the same grads are None
    average_over_workers_(p.grad for p in model.parameters() if p.grad is not None)


def mean_over_workers(value: float, device: str | torch.device = "cpu") -> float:
    """The mean of a scalar over the workers (the value itself when alone)."""
    world = current_world()
    if world.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t) / world.size


def barrier() -> None:
    if current_world().size > 1:
        dist.barrier()


# -- FSDP2 (``--fsdp``): the engine's three calls, the logic in comera.integrations.fsdp ---
GradHook = Callable[[nn.Module], None]


def prepare_model_(model: nn.Module, fsdp: bool = False,
                   max_grad_norm: float | None = None) -> tuple[GradHook, float | None]:
    """Make ``model`` ready for data-parallel training; return the trainer's gradient hook and
    the ``max_grad_norm`` to give the trainer. Plain replication: :func:`average_gradients`, and
    the trainer clips. With ``fsdp``: the dense parts sharded by FSDP2, the TT layers kept
    replicated (:func:`comera.integrations.fsdp.shard_`); the hook averages the replicated
    gradients and clips by the global norm (:func:`comera.integrations.fsdp.gradient_hook`), so the
    trainer gets None. Call it after :func:`broadcast_parameters_` and before building the
    optimizer."""
    if not fsdp:
        return average_gradients, max_grad_norm
    from comera.integrations.fsdp import gradient_hook, shard_

    if current_world().size == 1 and not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("--fsdp shards over data-parallel workers: run with --nproc N (N >= 2)"
                          " or under torchrun.")
    shard_(model)
    return gradient_hook(max_grad_norm), None


def save_run_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                        fsdp: bool = False, **extra: Any) -> None:
    """Write the run's checkpoint: worker 0 alone, or with ``fsdp`` every worker (the sharded
    state is gathered whole first; the file is the same comera format)."""
    if fsdp:
        from comera.integrations.fsdp import save_checkpoint

        save_checkpoint(path, model, optimizer, **extra)
    elif current_world().is_main:
        save_checkpoint_plain(path, model, optimizer, **extra)


def load_run_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                        fsdp: bool = False) -> dict[str, Any]:
    """Load the run's checkpoint into ``model`` and ``optimizer`` (sharded ones with ``fsdp``);
    return its ``extra``."""
    if fsdp:
        from comera.integrations.fsdp import load_checkpoint

        return load_checkpoint(path, model, optimizer)
    return load_checkpoint_plain(path, model, optimizer)
