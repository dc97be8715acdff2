"""The experiments ``comera train`` knows: a task and its quick / full engine settings.

Quick settings finish in a few minutes on 2 CPU cores (dense and CoMERA together); full settings
are the paper-scale runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from comera.errors import ConfigError
from comera.experiments.engine import EngineConfig
from comera.experiments.task import Task


@dataclass(frozen=True)
class Experiment:
    """One model ``comera train`` knows (the CLI lists :data:`EXPERIMENTS`' keys)."""

    name: str
    description: str
    make_task: Callable[..., Task]  # (quick, init_from=None) -> task
    quick: EngineConfig
    full: EngineConfig
    init_from: bool = False  # whether the task can start from a `comera train mlm` checkpoint
    checkpoint_blocks: bool = False  # whether its models have encoder blocks to checkpoint
    parametrization: bool = False  # whether make_task takes the layers' parametrization

    def engine(self, quick: bool) -> EngineConfig:
        return self.quick if quick else self.full


def _transformer(quick: bool, init_from: str | None = None) -> Task:
    from comera.experiments.transformer_task import ReviewsTask, ReviewsTaskConfig

    config = ReviewsTaskConfig() if quick else ReviewsTaskConfig.full()
    return ReviewsTask(replace(config, init_from=init_from))


def _transformer_code(quick: bool, init_from: str | None = None) -> Task:
    from comera.experiments.pair_task import CodePairTask, CodePairTaskConfig

    config = CodePairTaskConfig() if quick else CodePairTaskConfig.full()
    return CodePairTask(replace(config, init_from=init_from))


def _dlrm(quick: bool) -> Task:
    from comera.experiments.dlrm_task import DLRMTask, DLRMTaskConfig

    return DLRMTask(DLRMTaskConfig.quick() if quick else DLRMTaskConfig.full())


def _mlm(quick: bool, parametrization: str | None = None) -> Task:
    from comera.experiments.mlm_task import MLMTask, MLMTaskConfig

    config = MLMTaskConfig() if quick else MLMTaskConfig.full()
    return MLMTask(config if parametrization is None
                   else replace(config, parametrization=parametrization))


def _lm(quick: bool, parametrization: str | None = None) -> Task:
    from comera.experiments.lm_task import LMTask, LMTaskConfig

    config = LMTaskConfig() if quick else LMTaskConfig.full()
    return LMTask(config if parametrization is None
                  else replace(config, parametrization=parametrization))


# Both transformer tasks train the same classifier the same way.
_TRANSFORMER_QUICK = EngineConfig(steps_early=400, steps_late=200, batch_size=32, lr=1e-3,
                                  warmup=100, lam=0.05, target_compression=150.0, eval_every=100)
_TRANSFORMER_FULL = EngineConfig(steps_early=6000, steps_late=3000, batch_size=32, lr=3e-4,
                                 warmup=500, lam=0.05, target_compression=150.0, eval_every=500,
                                 checkpoint_every=1000)

EXPERIMENTS: dict[str, Experiment] = {
    "transformer": Experiment(
        "transformer", "six-encoder transformer on (title, review) -> recommended, Women's "
        "E-Commerce Clothing Reviews", _transformer,
        quick=_TRANSFORMER_QUICK, full=_TRANSFORMER_FULL,
        init_from=True, checkpoint_blocks=True,
    ),
    "transformer-code": Experiment(
        "transformer-code", "six-encoder transformer on the stdlib docstring/code pair task",
        _transformer_code,
        quick=_TRANSFORMER_QUICK, full=_TRANSFORMER_FULL,
        init_from=True, checkpoint_blocks=True,
    ),
    "dlrm": Experiment(
        "dlrm", "DLRM on synthetic Criteo-shaped click data (TT embedding tables)", _dlrm,
        quick=EngineConfig(steps_early=300, steps_late=150, batch_size=256, lr=1e-3,
                           lam=0.005, target_compression=99.0, eval_every=75),
        full=EngineConfig(steps_early=6000, steps_late=3000, batch_size=2048, lr=1e-3,
                          lam=0.01, target_compression=99.0, eval_every=500,
                          checkpoint_every=1000),
    ),
    "mlm": Experiment(
        "mlm", "BERT-style masked-language model on CPython standard-library sources", _mlm,
        quick=EngineConfig(steps_early=300, steps_late=150, batch_size=32, lr=1e-3, warmup=50,
                           lam=0.02, target_compression=8.0, eval_every=75),
        full=EngineConfig(steps_early=8000, steps_late=4000, batch_size=64, lr=5e-4,
                          warmup=500, lam=0.02, target_compression=8.0, eval_every=500,
                          checkpoint_every=1000),
        checkpoint_blocks=True, parametrization=True,
    ),
    "lm": Experiment(
        "lm", "GPT-style causal language model on CPython standard-library sources "
        "(metric: validation perplexity)", _lm,
        quick=EngineConfig(steps_early=300, steps_late=150, batch_size=16, lr=2e-3, warmup=50,
                           lam=0.02, target_compression=8.0, eval_every=75),
        full=EngineConfig(steps_early=8000, steps_late=4000, batch_size=32, lr=6e-4,
                          warmup=500, lam=0.02, target_compression=8.0, eval_every=500,
                          checkpoint_every=1000),
        parametrization=True,
    ),
}


def experiment(name: str) -> Experiment:
    try:
        return EXPERIMENTS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; choose one of "
                          f"{', '.join(EXPERIMENTS)}.") from None
