"""What the studies of trained models share (issue 31): the quick LM / MLM task, its calibration
rows and batches, the task as the engine trains a given (compressed) model, and the scores."""

from __future__ import annotations

import argparse
import copy
import math
import resource
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import comera
from benchmarks.lib.measure import RESULTS
from comera.experiments.engine import EngineConfig, train_model
from comera.experiments.lm_task import IGNORE_INDEX, LMTask, LMTaskConfig, next_token_targets
from comera.experiments.mlm_task import MLMTask, MLMTaskConfig
from comera.experiments.task import Task
from comera.formats.registry import DENSE, layer_formats
from comera.models.mlm import masked_logits
from comera.ranks.size import dense_size

__all__ = ["CALIB_BATCH", "CONVERTIBLE", "OUT", "ForEngine", "MaskedLMLoss", "best_cell",
           "calibration_batches", "calibration_rows", "compression_target", "engine_run",
           "grid_table", "labelled_batches", "linear_sizes", "make_task", "model_input",
           "next_token_loss", "peak_rss_mib", "score"]

#: The formats ``convert_`` can make from a trained layer (a declared network cannot): the
#: studies' ``--format(s)`` choices, so a typo is refused before anything is loaded or trained.
CONVERTIBLE = tuple(name for name in layer_formats() if name != DENSE)


def compression_target(text: str) -> float:
    """An argparse type for ``--target(s)``: a compression ratio above 1, as ``convert_``
    takes, refused while the arguments are read (before anything is loaded or trained)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 1):
        raise argparse.ArgumentTypeError(f"{text!r}: a target is a compression ratio above 1, "
                                         "e.g. 2 for half the parameters")
    return value


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
    return _epoch0_masks(task, rows)[0]


def _epoch0_masks(task: MLMTask, rows: Tensor) -> tuple[Tensor, Tensor]:
    """(masked inputs, labels) of MLM rows ``rows`` under their epoch-0 BERT masks."""
    return task.masking(rows, torch.arange(rows.shape[0]), 0, task.config.seed)


def next_token_loss(logits: Tensor, inputs: Tensor) -> Tensor:
    """The LM's loss on a calibration batch that holds only the model's inputs (rows but their
    last token): each position but the last predicts the next input token (``allocation=
    "sensitivity"``'s ``loss=``; special tokens ignored as the task's loss ignores them)."""
    _, targets = next_token_targets(inputs)  # (b, s-2)
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(),
                                       ignore_index=IGNORE_INDEX)


def calibration_rows(task: Task, seed: int, count: int) -> Tensor:
    """``count`` training-row indices drawn with ``seed`` (the calibration set of that seed)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    return torch.randperm(task.train_size(), generator=gen)[:count]


def calibration_batches(task: Task, indices: Tensor) -> list[Tensor]:
    """The model inputs of the rows at ``indices``, in batches of :data:`CALIB_BATCH`."""
    rows = task.train.ids[indices]
    return [model_input(task, chunk) for chunk in rows.split(CALIB_BATCH)]


def labelled_batches(task: MLMTask, indices: Tensor) -> list[tuple[Tensor, Tensor]]:
    """The MLM's calibration batches with their targets: (masked inputs, labels) of the rows at
    ``indices``, the inputs equal to :func:`calibration_batches`' (the same epoch-0 masks), so
    a loss can be measured on them (:class:`MaskedLMLoss`)."""
    return [_epoch0_masks(task, chunk) for chunk in task.train.ids[indices].split(CALIB_BATCH)]


class MaskedLMLoss(nn.Module):
    """The MLM whose forward takes (inputs, labels) and returns the masked-token cross-entropy:
    what ``allocation="sensitivity"`` measures on :func:`labelled_batches` (the MLM's own
    forward takes no targets). Its layers are the MLM's, under the prefix ``model.``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: Tensor, labels: Tensor) -> Tensor:
        logits, targets = masked_logits(self.model, inputs, labels)
        return nn.functional.cross_entropy(logits, targets)


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


# -- fine-tune grids ------------------------------------------------------------------------------
#: One arm's fine-tune grid: (parametrization or None, rate) -> (before, after) per seed, in seed
#: order.
Grid = dict[tuple[str | None, float], list[tuple[float, float]]]


def best_cell(cells: dict) -> Any:
    """The key of ``cells`` (values: one score per seed, lower is better; in seed order) of the
    lowest mean, judged on the seeds every cell holds: a grid screened on one seed, then
    repeated at its best on more, is judged on the screening seed."""
    shared = min(len(v) for v in cells.values())
    return min(cells, key=lambda k: sum(cells[k][:shared]) / shared)


def _mean_sd(values: list[float]) -> str:
    mean = sum(values) / len(values)
    if len(values) < 2:
        return f"{mean:.2f}"
    sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
    return f"{mean:.2f} ± {sd:.2f}"


def grid_table(arms: dict[str, Grid], pretrain_lr: float) -> str:
    """Per arm (and parametrization, where several were measured; rows): perplexity before
    fine-tuning and after it at each rate (columns), the mean over seeds ± their sd (the number
    of seeds in brackets where the cells differ in it), the arm's best cell in bold, and that
    cell's rate as a multiple of ``pretrain_lr`` (``edge``: the smallest or largest rate
    measured for the arm, so its optimum may lie beyond the grid)."""
    lrs = sorted({lr for grid in arms.values() for _, lr in grid})
    several = len({p for grid in arms.values() for p, _ in grid if p is not None}) > 1
    counts = {len(v) for grid in arms.values() for v in grid.values()}
    head = "| arm | " + ("parametrization | " if several else "") + "before | "
    lines = [head + " | ".join(f"after, lr {lr:g}" for lr in lrs) + " | best |",
             "|---|" + ("---|" if several else "") + "---|" + "---|" * len(lrs) + "---|"]
    for arm, grid in arms.items():
        best = best_cell({k: [after for _, after in v] for k, v in grid.items()})
        arm_lrs = sorted({lr for _, lr in grid})
        edge = len(arm_lrs) > 1 and best[1] in (arm_lrs[0], arm_lrs[-1])
        for p in dict.fromkeys(p for p, _ in grid):
            first = grid[p, min(lr for q, lr in grid if q == p)]
            shown = []
            for lr in lrs:
                if (p, lr) not in grid:
                    shown.append("-")
                    continue
                text = _mean_sd([after for _, after in grid[p, lr]])
                text += f" ({len(grid[p, lr])})" if len(counts) > 1 else ""
                shown.append(f"**{text}**" if (p, lr) == best else text)
            note = (f"{best[1]:g} ({best[1] / pretrain_lr:.2g}x" + (", edge" if edge else "")
                    + ")" if p == best[0] else "")
            label = f"| {arm} | " + (f"{p or '-'} | " if several else "")
            lines.append(label + f"{_mean_sd([b for b, _ in first])} | " + " | ".join(shown)
                         + f" | {note} |")
    return "\n".join(lines)
