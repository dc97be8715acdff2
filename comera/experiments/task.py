"""What an experiment needs from a model + data set, so one engine trains all of them.

A :class:`Task` builds its model (dense or TT), hands out training batches by example index and
scores a split. The engine (:mod:`comera.experiments.engine`) owns everything else: which indices
form step ``s`` (:class:`IndexStream`, a pure function of seed and step, so a resumed or
distributed run sees exactly the batches an uninterrupted single-process run would), the
optimizer, the CoMERA stages, checkpoints, progress and the results files.
"""

from __future__ import annotations

import inspect
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor, nn

from comera import ConfigError
from comera.formats.registry import DENSE, check_layer_format
from comera.formats.tt_flag import FLAG_FORMAT, format_from_tt
from comera.layers.linear import FRESH_FORMAT

Batch = Any  # whatever ``Task.batch`` returns and ``Task.loss`` takes (tensors, tuples of them)


def model_format(format: str | bool) -> str:
    """A layer kind as a task takes it: ``"dense"`` or a registered format (checked, else a
    :class:`ConfigError` naming the choices). The boolean of before (``tt=True`` / ``False``)
    is read as ``"tt"`` / ``"dense"`` for one release, with a DeprecationWarning."""
    if isinstance(format, bool):
        kind = FLAG_FORMAT if format else DENSE
        warnings.warn(f"build_model({format}) takes a format now: {kind!r} (or any registered "
                      "format name); the boolean goes in the next release.",
                      DeprecationWarning, stacklevel=3)
        return kind
    return check_layer_format(format)


def run_format(config: Any, tt: bool | None = None, call: str = "config.format={}") -> str:
    """The layer kind of a run of ``config`` (an
    :class:`~comera.experiments.engine.EngineConfig`): ``config.format``, ``"dense"`` for the
    dense baseline. ``tt``: the flag of before (True: ``config.format``; False: ``"dense"``),
    read until 0.3.0 with a DeprecationWarning naming ``call`` (formatted with the kind)."""
    if tt is None:
        return config.format
    return format_from_tt(tt, config.format, call, stacklevel=4)


def build_task_model(task: Task, format: str) -> nn.Module:
    """``task.build_model(format)``. A task written before formats (``build_model(self, tt)``)
    gets the boolean it expects, with a DeprecationWarning, for one release; it builds TT or
    dense only."""
    if "tt" not in inspect.signature(task.build_model).parameters:
        return task.build_model(format)
    if format not in (FLAG_FORMAT, DENSE):
        raise ConfigError(f"task {task.name!r} builds its model with build_model(tt), so it "
                          f"knows TT and dense only, not format {format!r}; train it with "
                          f"format={FLAG_FORMAT!r} (EngineConfig(format={FLAG_FORMAT!r})), or "
                          "give it build_model(self, format) (see comera.experiments.task.Task).")
    warnings.warn(f"task {task.name!r}: build_model(self, tt) is called with a format now "
                  "(\"tt\", \"dense\" or any registered format name); rename its argument, the "
                  "boolean goes in the next release.", DeprecationWarning, stacklevel=3)
    return task.build_model(format == FLAG_FORMAT)


class Task(ABC):
    """A model family and its data. Subclasses set ``name`` and ``metric``, and may set
    ``recommended_format``."""

    name: str = "task"
    metric: str = "accuracy"  # the key of ``evaluate``'s result that the summary reports
    higher_is_better: bool = True
    #: The format ``comera train`` gives the CoMERA run when none is named (``--format``): by
    #: default :data:`~comera.layers.linear.FRESH_FORMAT`, the format of layers trained from
    #: scratch; a task whose results were measured in another keeps that one.
    recommended_format: str = FRESH_FORMAT

    @abstractmethod
    def build_model(self, format: str = FRESH_FORMAT) -> nn.Module:
        """The model with its layers of the kind ``format`` (a registered format name, e.g.
        ``"tt"``, or ``"dense"``; read it through :func:`model_format`), initialised from the
        current RNG."""

    @abstractmethod
    def train_size(self) -> int:
        """Number of training examples."""

    @abstractmethod
    def batch(self, indices: Tensor) -> Batch:
        """The training examples at ``indices`` (int64, 1-D), collated."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        """Mean training loss of ``model`` on ``batch`` (a scalar with grad)."""

    @abstractmethod
    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        """Scores on ``split`` ("val" or "test"): at least ``"loss"`` and ``self.metric``.

        Called in eval mode under ``torch.no_grad``; the engine restores train mode.
        """

    def step_batch(self, stream: IndexStream, step: int, rank: int = 0,
                   world: int = 1) -> Batch:
        """The batch worker ``rank`` of ``world`` trains on at ``step`` (what the engine calls).

        The default collates ``stream.shard(...)``. Override it when an example depends on the
        pass over the data, e.g. fresh MLM masks per epoch: ``stream.epochs(...)`` gives the
        epoch of each example, so resumed and data-parallel runs see the same batches.
        """
        return self.batch(stream.shard(step, rank, world))

    def describe(self) -> dict[str, Any]:
        """Sizes of the data set and anything else worth recording in the results."""
        return {"train": self.train_size()}


@lru_cache(maxsize=2)
def _permutation(size: int, seed: int) -> Tensor:
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed))


@dataclass(frozen=True)
class IndexStream:
    """The example indices of every step: epoch ``e`` is a permutation seeded by ``seed + e``.

    ``indices(step)`` is the global batch of that step; ``shard(step, rank, world)`` the part one
    of ``world`` data-parallel workers takes (contiguous, equal sizes).
    """

    size: int
    batch_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"the training set is empty (size={self.size}).")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size}; it must be >= 1.")

    def _epoch_order(self, epoch: int) -> Tensor:
        return _permutation(self.size, self.seed + epoch)

    def indices(self, step: int) -> Tensor:
        """The global batch of ``step``: ``batch_size`` example indices (int64), continuing into
        the next epoch's permutation when an epoch runs out."""
        start = step * self.batch_size
        out, filled = [], 0
        while filled < self.batch_size:
            epoch, offset = divmod(start + filled, self.size)
            take = min(self.batch_size - filled, self.size - offset)
            out.append(self._epoch_order(epoch)[offset:offset + take])
            filled += take
        return torch.cat(out)

    def shard(self, step: int, rank: int, world: int) -> Tensor:
        """Worker ``rank``'s contiguous share of ``indices(step)`` among ``world`` workers
        (``batch_size`` must split evenly over them)."""
        if self.batch_size % world:
            raise ConfigError(f"batch_size={self.batch_size} does not split over {world} "
                              "workers; use a multiple of the worker count.")
        per = self.batch_size // world
        return self.indices(step)[rank * per:(rank + 1) * per]

    def epochs(self, step: int, rank: int = 0, world: int = 1) -> Tensor:
        """The epoch of each example of ``shard(step, rank, world)`` (int64, aligned with it)."""
        self.shard(step, rank, world)  # validates the split over workers
        start = step * self.batch_size
        epochs = torch.arange(start, start + self.batch_size) // self.size  # (batch_size,)
        per = self.batch_size // world
        return epochs[rank * per:(rank + 1) * per]


def spread_subset(n: int, limit: int | None, seed: int) -> Tensor:
    """A fixed subset of ``limit`` of ``n`` indices, ascending (all of them when limit is None):
    the examples a task evaluates on when its evaluation is capped."""
    if limit is None or limit >= n:
        return torch.arange(n)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return order[:limit].sort().values
