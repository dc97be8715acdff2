"""What the studies of trained models share (issue 31): the quick LM / MLM task, its calibration
rows and batches, the task as the engine trains a given (compressed) model, and the scores."""

from __future__ import annotations

import copy
import resource
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn

import comera
from benchmarks.lib.measure import RESULTS
from comera.experiments.engine import EngineConfig, train_model
from comera.experiments.lm_task import LMTask, LMTaskConfig
from comera.experiments.mlm_task import MLMTask, MLMTaskConfig
from comera.experiments.task import Task
from comera.ranks.size import dense_size

__all__ = ["CALIB_BATCH", "OUT", "ForEngine", "calibration_batches", "calibration_rows",
           "engine_run", "linear_sizes", "make_task", "model_input", "peak_rss_mib", "score"]

OUT = RESULTS / "compress_trained"
CALIB_BATCH = 32


# -- tasks ----------------------------------------------------------------------------------------
def make_task(name: str, smoke: bool = False, root: Path | None = None) -> Task:
    """The quick LM or MLM task (``smoke``: a tiny model on a tiny corpus, for tests)."""
    if name == "lm":
        config = LMTaskConfig()
        if smoke:
            config = replace(config, seq_len=16, vocab_size=64, d_model=16, n_heads=2, d_ff=32,
                             n_layers=1, eval_limit=8)
        return LMTask(config, root=root)
    if name == "mlm":
        config = MLMTaskConfig()
        if smoke:
            config = replace(config, seq_len=16, vocab_size=64, d_model=16, n_heads=2, d_ff=32,
                             n_layers=1, eval_limit=8, embedding_rank=4)
        return MLMTask(config, root=root)
    raise SystemExit(f"--task {name!r}: choose lm or mlm")


def model_input(task: Task, rows: Tensor) -> Tensor:
    """What the model's forward takes for training rows ``rows``: the LM reads all but the last
    token; the MLM reads the rows with epoch-0 BERT masks."""
    if isinstance(task, LMTask):
        return rows[:, :-1]
    indices = torch.arange(rows.shape[0])
    return task.masking(rows, indices, 0, task.config.seed)[0]


def calibration_rows(task: Task, seed: int, count: int) -> Tensor:
    """``count`` training-row indices drawn with ``seed`` (the calibration set of that seed)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    return torch.randperm(task.train_size(), generator=gen)[:count]


def calibration_batches(task: Task, indices: Tensor) -> list[Tensor]:
    """The model inputs of the rows at ``indices``, in batches of :data:`CALIB_BATCH`."""
    rows = task.train.ids[indices]
    return [model_input(task, chunk) for chunk in rows.split(CALIB_BATCH)]


class ForEngine(Task):
    """``task`` as the engine trains it: with ``model``, the engine trains a copy of that model
    (a compressed one) instead of building one; with ``rows``, only those training rows (the
    gates' calibration set). The LM task's ``step_batch`` predates the engine's data-parallel
    arguments, so batches are collated here from the engine's index stream."""

    def __init__(self, task: Task, model: nn.Module | None = None, rows: Tensor | None = None):
        self.task, self.model, self.rows = task, model, rows
        self.name, self.metric = task.name, task.metric
        self.higher_is_better = task.higher_is_better

    def build_model(self, format: str) -> nn.Module:
        return self.task.build_model(format) if self.model is None else copy.deepcopy(self.model)

    def train_size(self) -> int:
        return self.task.train_size() if self.rows is None else int(self.rows.numel())

    def batch(self, indices: Tensor):
        return self.task.batch(indices if self.rows is None else self.rows[indices])

    def step_batch(self, stream, step: int, rank: int = 0, world: int = 1):
        if self.rows is None and isinstance(self.task, MLMTask):  # masks follow the epoch
            return self.task.step_batch(stream, step, rank, world)
        indices = stream.shard(step, rank, world)
        if self.rows is not None and isinstance(self.task, MLMTask):
            return self.task.batch(self.rows[indices], stream.epochs(step, rank, world))
        return self.batch(indices)

    def loss(self, model: nn.Module, batch) -> Tensor:
        return self.task.loss(model, batch)

    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        return self.task.evaluate(model, split)


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (MiB; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def linear_sizes(model: nn.Module) -> tuple[int, int]:
    """(parameters, dense parameters) of the gated layers, biases included."""
    return (comera.model_size(model, only=comera.GatedLayer),
            dense_size(model, only=comera.GatedLayer))


def score(task: Task, model: nn.Module) -> dict[str, float]:
    model.eval()
    with torch.no_grad():
        return task.evaluate(model, "val")


def engine_run(task: Task, model: nn.Module, config: EngineConfig,
               rows: Tensor | None = None) -> nn.Module:
    """``model`` trained by the engine as ``config`` says (on ``rows`` only, if given)."""
    with tempfile.TemporaryDirectory() as out:
        trained, _ = train_model(ForEngine(task, model, rows), "comera", config, Path(out))
    return trained.eval()
