"""DLRM click prediction as a :class:`~comera.experiments.task.Task`: dense tables vs TT tables.

The data is the synthetic Criteo generator at the Kaggle table sizes (capped by ``max_rows`` for
CPU runs), or the real Criteo TSV when ``tsv_path`` is set. The model is
:class:`~comera.models.dlrm.DLRM`; the reported metric is the ROC AUC on the split, with the
binary cross-entropy and the accuracy at logit 0 beside it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from comera import ConfigError, NonFiniteLossError
from comera.data import CriteoData, SyntheticCriteo, load_criteo_tsv, load_synthetic_criteo
from comera.data.criteo import CRITEO_KAGGLE_CARDINALITIES, SPLITS, describe_data
from comera.experiments.step_cost import probe_step
from comera.experiments.task import Task, model_format
from comera.formats.registry import DENSE
from comera.models import DLRM, DLRMConfig
from comera.numbers import is_int

log = logging.getLogger("comera.experiments")

Batch = tuple[Tensor, Tensor, Tensor]  # dense (B, 13) float32, sparse (B, T) int64, labels (B,)

# DLRMTask.at_scale: table caps as multiples of the run's max_rows (quick: 20,000 to 200,000
# rows per table; the dense step's time and memory grow with the rows, the TT step's barely),
# the training examples whose ids choose the hot rows of the TT tables there, and the steps timed
SCALE_FACTORS = (1, 3, 10)
SCALE_SAMPLE = 16_384
SCALE_STEPS = 3  # timed steps per model (after one warm-up; then one for the memory)


def binary_auc(scores: Tensor, labels: Tensor) -> float:
    """ROC AUC by the rank-sum (Mann-Whitney) formula; tied scores share their average rank.

    Equals the fraction of (positive, negative) pairs ranked correctly, ties counting one half.
    """
    s = scores.detach().reshape(-1).to(torch.float64)  # (N,)
    y = labels.detach().reshape(-1)  # (N,)
    if s.numel() != y.numel():
        raise ConfigError(f"binary_auc got {s.numel()} scores and {y.numel()} labels; give one "
                          "score per label.")
    if not bool(((y == 0) | (y == 1)).all()):
        raise ConfigError("binary_auc takes labels in {0, 1}; got other values.")
    if not bool(torch.isfinite(s).all()):
        raise NonFiniteLossError("binary_auc got non-finite scores (NaN or inf): the model "
                                 "diverged; lower the learning rate.")
    pos = y == 1  # (N,)
    n_pos = int(pos.sum())
    n_neg = s.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ConfigError(f"AUC needs both classes; got {n_pos} positives and {n_neg} "
                          "negatives. Evaluate on a larger split.")
    order = torch.argsort(s)  # (N,)
    _, group, counts = torch.unique_consecutive(s[order], return_inverse=True,
                                                return_counts=True)  # (N,), (G,)
    ends = torch.cumsum(counts, 0).to(torch.float64)  # (G,) 1-based rank of each group's last
    mean_rank = ends - (counts.to(torch.float64) - 1) / 2  # (G,)
    ranks = torch.empty_like(s)  # (N,)
    ranks[order] = mean_rank[group]
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


@dataclass(frozen=True)
class DLRMTaskConfig:
    """Data and model sizes; the defaults are :meth:`quick`, :meth:`full` is the reference
    Kaggle model on all 33.76M table rows. The engine owns the steps, batch size and learning
    rate (see :mod:`comera.experiments.registry`).

    Give ``n_train`` at least steps x batch size: click models are trained for about one pass
    over the data, as they overfit from the second on (dense tables memorise the rare ids).
    """

    cardinalities: tuple[int, ...] = CRITEO_KAGGLE_CARDINALITIES
    max_rows: int | None = 20_000  # caps every table, dense and TT alike
    n_train: int = 200_000
    n_val: int = 20_000
    n_test: int = 20_000
    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (64, 16)
    top_mlp: tuple[int, ...] = (64, 1)
    tt_ranks: int = 16
    tt_min_rows: int = 1_000  # smaller tables stay nn.Embedding in the TT model
    tt_d: int = 3
    tau: float = 1e-2
    # TT-Rec hot-row cache per TT table (its rows chosen from the training ids' counts); 0: off.
    tt_cache_rows: int = 0
    zipf_exponent: float = 1.05
    data_seed: int = 0
    tsv_path: str | None = None  # a real Criteo file instead of the synthetic data
    tsv_limit: int | None = None  # read only this many lines of it
    eval_batch_size: int = 8_192

    def __post_init__(self) -> None:
        for name in ("n_train", "eval_batch_size"):
            value = getattr(self, name)
            if not is_int(value):
                raise ConfigError(f"{name}={value!r}; it must be an int >= 1.")
        for name in ("n_val", "n_test"):
            value = getattr(self, name)
            if not is_int(value):
                raise ConfigError(f"{name}={value!r}; evaluate() scores this split, so it "
                                  "needs at least one example (both classes for the AUC).")
        self.model_config(DENSE)  # the model settings are checked there

    @classmethod
    def quick(cls, **overrides: Any) -> DLRMTaskConfig:
        """Tables capped at 20,000 rows (3.3M dense table parameters), small MLPs, 200k
        examples: a few minutes on two CPU cores for dense and TT together. TT tables keep 112
        hot rows: the measured best at 99x, 0.46 AUC points below dense over 3 seeds where plain
        TT is 3.3 points below (benchmarks/results/dlrm_cache)."""
        return cls(**{"tt_cache_rows": 112, **overrides})

    @classmethod
    def full(cls, **overrides: Any) -> DLRMTaskConfig:
        """The reference Criteo-Kaggle DLRM (13-512-256-64-16 / 367-512-256-1, dim 16, all
        33.76M rows), TT rank 32 on tables of 10,000 rows or more; 18M training examples,
        one pass at the registry's full run (9,000 steps of 2,048)."""
        base: dict[str, Any] = dict(
            max_rows=None, n_train=18_000_000, n_val=500_000, n_test=500_000,
            bottom_mlp=(512, 256, 64, 16), top_mlp=(512, 256, 1), tt_ranks=32,
            tt_min_rows=10_000)
        base.update(overrides)
        return cls(**base)

    def model_config(self, format: str = "tt") -> DLRMConfig:
        """The DLRM's config with its large tables of the kind ``format`` ("dense" or a format
        that holds tables: "tt" and "ttm" give TT-matrix tables)."""
        return DLRMConfig(cardinalities=self.cardinalities, embedding_dim=self.embedding_dim,
                          bottom_mlp=self.bottom_mlp, top_mlp=self.top_mlp,
                          max_rows=self.max_rows, table_format=model_format(format),
                          tt_ranks=self.tt_ranks,
                          tt_min_rows=self.tt_min_rows, tt_d=self.tt_d, tau=self.tau,
                          tt_cache_rows=self.tt_cache_rows)


class DLRMTask(Task):
    """DLRM on (synthetic or real) Criteo clicks; ``build_model(format)`` gives dense tables or
    tables in ``format`` (TT: TT-matrix tables) of the same sizes."""

    name = "dlrm"
    metric = "auc"
    higher_is_better = True
    # its results (`make run`) were measured as the "tt" run, whose tables are TT-matrix ones
    # (a TT format's tables): the CoMERA run keeps that name, so it builds, records and resumes
    # as it did
    recommended_format = "tt"

    def __init__(self, cfg: DLRMTaskConfig | None = None, data: CriteoData | None = None):
        self.cfg = cfg or DLRMTaskConfig()
        sizes = self.cfg.model_config(DENSE).table_sizes
        if data is None:
            data = self._load(sizes)
        if tuple(data.cardinalities) != sizes:
            raise ConfigError(f"the data's tables have {tuple(data.cardinalities)} rows but the "
                              f"model's {sizes} (cardinalities capped by max_rows="
                              f"{self.cfg.max_rows}); build both from one DLRMTaskConfig.")
        self.data = data

    def _load(self, sizes: tuple[int, ...]) -> CriteoData:
        cfg = self.cfg
        if cfg.tsv_path is not None:
            total = cfg.n_train + cfg.n_val + cfg.n_test
            fractions = (cfg.n_train / total, cfg.n_val / total, cfg.n_test / total)
            return load_criteo_tsv(cfg.tsv_path, sizes, fractions, limit=cfg.tsv_limit)
        generator = SyntheticCriteo(cardinalities=sizes, zipf_exponent=cfg.zipf_exponent,
                                    seed=cfg.data_seed)
        return load_synthetic_criteo(generator, cfg.n_train, cfg.n_val, cfg.n_test)

    # -- the Task protocol ----------------------------------------------------------------------
    def build_model(self, format: str = "tt") -> nn.Module:
        config = self.cfg.model_config(format)
        model = DLRM(config)
        if config.table_format != DENSE and self.cfg.tt_cache_rows:
            shares = model.choose_hot_rows_(self.data.train.sparse)
            log.info("hot-row caches of %d rows answer %s%% of the training lookups per table",
                     self.cfg.tt_cache_rows, shares)
        return model

    def train_size(self) -> int:
        return len(self.data.train)

    def batch(self, indices: Tensor) -> Batch:
        train = self.data.train
        return (train.dense[indices], train.sparse[indices].long(),  # (B, J), (B, T)
                train.labels[indices])  # (B,)

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        dense, sparse, labels = _to_device(batch, model)
        logits = model(dense, sparse)  # (B,)
        return nn.functional.binary_cross_entropy_with_logits(logits, labels)

    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        if split not in SPLITS:
            raise ConfigError(f"unknown split {split!r}; choose one of {SPLITS}.")
        data = self.data.split(split)
        if len(data) == 0:
            raise ConfigError(f"the {split} split is empty; raise n_{split} in DLRMTaskConfig.")
        step = self.cfg.eval_batch_size
        logits = []
        with torch.no_grad():
            for start in range(0, len(data), step):
                part = data.rows(start, start + step)
                dense, sparse, _ = _to_device((part.dense, part.sparse.long(), part.labels),
                                              model)
                logits.append(model(dense, sparse).float().cpu())  # (b,)
        scores = torch.cat(logits)  # (N,)
        labels = data.labels  # (N,)
        loss = nn.functional.binary_cross_entropy_with_logits(scores, labels)
        accuracy = ((scores > 0).float() == labels).float().mean()
        return {"loss": float(loss), "accuracy": float(accuracy),
                "auc": binary_auc(scores, labels)}

    def at_scale(self, config: Any) -> dict[str, Any] | None:
        """What the table cap hides: one training step of this DLRM, dense and TT, with every
        table capped at ``SCALE_FACTORS`` times the run's ``max_rows`` (time and peak memory,
        :func:`~comera.experiments.step_cost.probe_step`; ``config``: the run's
        :class:`~comera.experiments.engine.EngineConfig`). The TT tables are at their initial
        ranks, as the early stage trains them; the batch is ``config.batch_size`` examples of
        the synthetic generator at those sizes. None for uncapped tables or a TSV file, whose
        run measures its own tables."""
        cfg = self.cfg
        if cfg.max_rows is None or cfg.tsv_path is not None:
            return None
        load = [round(x, 2) for x in os.getloadavg()]
        rungs = []
        for factor in SCALE_FACTORS:
            capped = replace(cfg, max_rows=cfg.max_rows * factor)
            sizes = capped.model_config(DENSE).table_sizes
            sample = SyntheticCriteo(cardinalities=sizes, zipf_exponent=cfg.zipf_exponent,
                                     seed=cfg.data_seed).generate(SCALE_SAMPLE, "train")
            batch = (sample.dense[: config.batch_size].clone(),
                     sample.sparse[: config.batch_size].long(),
                     sample.labels[: config.batch_size].clone())
            rung: dict[str, Any] = {"max_rows": capped.max_rows, "table_rows": sum(sizes),
                                    "dense_table_parameters": sum(sizes) * cfg.embedding_dim}
            for name, format in (("dense", DENSE), ("tt", config.format)):
                torch.manual_seed(config.seed)
                model = DLRM(capped.model_config(format))
                if format != DENSE and capped.tt_cache_rows:
                    model.choose_hot_rows_(sample.sparse)
                model = model.to(config.device)
                cost = probe_step(model, lambda m, b=batch: self.loss(m, b),
                                  replace(config, format=format), inputs=batch,
                                  steps=SCALE_STEPS)
                rung[name] = {"ms": cost.ms, "step_ms": list(cost.step_ms),
                              "peak_bytes": cost.peak_bytes,
                              "table_parameters": model.table_parameters()}
                del model
            rungs.append(rung)
        faster = None  # the smallest cap from which TT was faster at every larger one too
        for rung in reversed(rungs):
            if rung["tt"]["ms"] >= rung["dense"]["ms"]:
                break
            faster = rung["max_rows"]
        return {"batch_size": config.batch_size, "threads": torch.get_num_threads(),
                "load_average": [load, [round(x, 2) for x in os.getloadavg()]],
                "rungs": rungs, "tt_faster_from": faster,
                "kaggle_rows": sum(CRITEO_KAGGLE_CARDINALITIES),
                "kaggle_dense_table_bytes": sum(CRITEO_KAGGLE_CARDINALITIES) * cfg.embedding_dim
                * 4, "tt_ranks": cfg.tt_ranks, "tt_cache_rows": cfg.tt_cache_rows}

    def describe(self) -> dict[str, Any]:
        dense = self.cfg.model_config(DENSE)
        return {**describe_data(self.data), "source": self.cfg.tsv_path or "synthetic",
                "table_sizes": list(dense.table_sizes),
                "dense_table_parameters": sum(dense.table_sizes) * dense.embedding_dim}


def _to_device(batch: Batch, model: nn.Module) -> Batch:
    param = next(model.parameters())
    dense, sparse, labels = batch
    return (dense.to(param.device, param.dtype), sparse.to(param.device),
            labels.to(param.device, param.dtype))
