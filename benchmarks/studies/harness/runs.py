"""One model of a study through the engine, and its row.

A study's task is a :class:`comera.experiments.task.Task` that also builds a model of any layer
kind at a rank and of other sizes, ``build(format, rank=None, **sizes)``, and names the layers
compression speaks of, ``block_linears(model)`` (the language-model tasks have both; the
reviews task of :mod:`.reviews` adds them). :func:`train` hands a model to
:func:`comera.experiments.engine.train_model`, which owns the loop; :func:`row` turns the trained
model and the engine's record into plain data: the val and test scores the engine measured at the
end, the size and ranks of the block layers, and the curves (training loss per step; the
validation scores at each evaluation, against the step and the measured training wall-clock).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import nn

import comera
from comera.experiments.engine import EngineConfig, RunRecord, train_model

__all__ = ["curves", "layer_ranks", "layer_shapes", "layer_sizes", "row", "train"]


def train(task, name: str, format: str, config: EngineConfig, work: Path,
          build: Callable[[], nn.Module] | None = None, start_step: int = 0,
          resume: bool = False) -> tuple[nn.Module, RunRecord]:
    """Train one model of ``task`` with layers of the kind ``format`` (``"dense"`` or a
    registered format: a CoMERA run of it) on the engine, in the run folder ``work`` under the
    name ``name``. ``build``: the model to train, made after the run seeds the RNG (default: the
    task's ``build_model(format)``); ``start_step``, ``resume``: as ``train_model``'s."""
    return train_model(task, name, replace(config, format=format), work, resume=resume,
                       build=build, start_step=start_step)


def layer_sizes(layers: list[tuple[str, nn.Module]]) -> tuple[int, int]:
    """(parameters at the effective ranks, dense parameters) of ``layers``, biases included: a
    gated layer counts as its layout says, any other module as its parameters."""
    params = dense = 0
    for _, layer in layers:
        if isinstance(layer, comera.GatedLayer):
            params += layer.num_parameters()
            dense += layer.dense_num_parameters()
        else:
            n = sum(p.numel() for p in layer.parameters())
            params, dense = params + n, dense + n
    return params, dense


def layer_ranks(layers: list[tuple[str, nn.Module]]) -> dict[str, list[int]]:
    """Each gated layer's effective ranks (a chain's with its ends)."""
    return {name: list(m.ranks) for name, m in layers if isinstance(m, comera.GatedLayer)}


def layer_shapes(layers: list[tuple[str, nn.Module]]) -> list[tuple[int, int, bool]]:
    """(in_features, out_features, bias) of each layer."""
    return [(m.in_features, m.out_features, m.bias is not None) for _, m in layers]


def curves(record: RunRecord) -> dict[str, list]:
    """The training loss per step, ``[step, loss]``, and the validation scores at each
    evaluation, ``[step, training seconds, scores]``."""
    val = [[step, None if seconds is None else round(seconds, 3), scores]
           for (step, scores), seconds in itertools.zip_longest(record.val_curve,
                                                                record.val_seconds)]
    return {"train": [[step, loss] for step, loss, *_ in record.train_curve], "val": val}


def row(task, model: nn.Module, record: RunRecord, **extra: Any) -> dict[str, Any]:
    """A results row: ``extra`` (seed, method, target, lr ...), the val and test scores at the
    end of the run, the block layers' size (``linear_params``, ``linear_dense``,
    ``compression``) and ranks, the training seconds and steps, and the curves."""
    end = record.stage_ends[list(record.stage_ends)[-1]]
    layers = task.block_linears(model)
    params, dense = layer_sizes(layers)
    return {**extra, "val": end["val"], "test": end["test"], "linear_params": params,
            "linear_dense": dense, "compression": dense / max(params, 1),
            "ranks": layer_ranks(layers), "seconds": round(record.train_seconds, 3),
            "steps": record.steps, "curves": curves(record)}
