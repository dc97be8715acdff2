"""The methods a study compares, by layer kind, each trained on the engine from one seed.

- ``"dense"``: the task's dense model, all ``steps``.
- a registered format (``"tt"``, ``"ttm"``, ``"btt"``, ``"lowrank"`` ...): every block layer in
  the format at the largest uniform rank whose block layers hold at most dense / target
  parameters (:meth:`Study.uniform_rank`: :func:`comera.ranks.budget.largest_rank` over the
  layouts of the task's model), trained at that rank without the rank objective (lam 0, no late
  stage), all ``steps``. No row where not even rank 1 fits.
- a format with a parametrization, ``"tt:balanced"`` / ``"tt:plain"``: the same with the layers
  at that parametrization (:mod:`comera.formats.scaling`); without one, the task's (plain for
  the studies: plain, :data:`benchmarks.studies.harness.frontier.STUDY_PARAMETRIZATION`).
- a format with options after ``+`` (``"btt+zero+rms:balanced"``,
  :mod:`benchmarks.studies.harness.options`): the same model, changed as each option says
  (``zero``: each residual branch's output layer starts at zero; ``rms`` / ``rms2``: every core
  bounded to once / twice its initial RMS after each step; ``cbs``: each core at the
  structure-aware rate; ``cores2``: 2 modes per side, the rank read at that order). The row's
  method keeps the options, so they have rows (and at equal wall-clock clock entries,
  ``btt+rms 8x``) of their own.
- a layer kind that is not a weight format (``"cola"``, ``"cola:balanced"``:
  :data:`comera.models.transformer.LAYER_KINDS`): the same as a format, its size read from the
  layers' own layout (CoLA's A and B: ``r * (in + out)``). The tasks and the engine take only
  formats (:func:`comera.experiments.task.model_format`), so the harness builds the causal LM
  with the layers of that kind itself (:func:`build`; the LM task only) and the engine runs it
  as a ``"lowrank"`` run (:data:`ENGINE_KIND`: a run with gated layers at lam 0, as the
  formats' fixed ranks; the rows name the kind).
- ``"narrow"`` with ``widths``: instead, the dense model at each d_model of ``widths`` (d_ff at
  the task's ratio, the heads dividing d_model: :meth:`Study.width_sizes`), a row per width
  named ``"dense@<width>"`` with no target: the dense frontier's widths, given.
- ``"narrow"``: the same architecture, dense, with a smaller d_model (a multiple of the heads, the
  FFN's ratio kept) and then d_ff filling the budget: the largest whose whole model holds at
  most as many parameters as the compressed model at the target (dense / target in the block
  layers, the rest as the task's model has it; :func:`narrow_sizes`), all ``steps``. Its
  token table shrinks with d_model too, so its block layers get more than dense / target.
- ``"comera"``: CoMERA as the frontiers run it: the TT model at ``max_rank``, ``early`` steps of
  the early stage (loss + lam R), rounded exactly; then per target the late stage from there on
  the next batches (``steps - early`` steps, a fresh optimizer, loss target 0: its step budget
  prunes to the target along the schedule). ``"comera:balanced"``: the same, its TT layers
  balanced.
- ``"comera@btt"`` / ``"comera@btt:balanced"``: the same on any format that trains
  rank-adaptively (:func:`adaptive_formats`: every registered layer format, each has gates to
  prune). The early model starts at :meth:`Study.start_rank`: the format's largest uniform rank
  whose block layers still compress (or compress at least ``comera_start``), at most
  ``max_rank``: a rank above it holds more parameters than dense (BTT's do at ranks far below
  TT's), so its early stage would train a model bigger than the one it is compared with.
  Rounding is the format's exact one where it has one (:func:`comera.ranks.truncate.round_`
  leaves the others as they are: the row says ``exact_rounding``); the late stage's
  ``"spectrum"`` allocation reads tensor-train chains only, so other formats are refused it
  before any training (``"prune"`` runs on every format). ``"comera"`` is ``"comera@tt"``
  started at ``max_rank`` whatever it compresses (the rows of before, unchanged) unless
  ``comera_start`` is set.
- ``"spectrum"``: the TT model at ``max_rank`` trained ``decide`` steps (lam 0), then per target
  the spectrum allocation (:func:`comera.ranks.allocate.allocate`) and a fresh model at the chosen
  ranks trained all ``steps``, as the fixed rank is.
- ``"early"``: the early stage alone with a size target (``EngineConfig.early_target``): the TT
  model at ``max_rank``, lam adapted toward the target, all ``steps``.

Every model is built by the engine right after it seeds the RNG with the seed (``build``), so a
method's model is drawn exactly as it was by the scripts before the harness.

At equal wall-clock (``Study.steps_of``, from a side-by-side clock of the models' steps), dense,
narrow and every format train for the steps their measured step time buys in dense's ``steps``,
each evaluated at every ``1 / evals`` of its budget; the adaptive methods (:data:`ADAPTIVE`) are
refused there (their step time changes as their ranks fall).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.studies.harness.options import (
    apply_options,
    option_sizes,
    options_title,
    split_options,
)
from benchmarks.studies.harness.runs import layer_shapes, row, train
from comera.errors import ConfigError
from comera.experiments.engine import EngineConfig
from comera.experiments.lm_task import LMTask
from comera.formats.registry import DENSE, format_names, get_format, layer_formats
from comera.formats.scaling import PARAMETRIZATIONS, check_parametrization
from comera.models.causal_lm import CausalLM
from comera.models.transformer import LAYER_KINDS
from comera.ranks.allocate import allocate, check_chain_format, rebuild_at_
from comera.ranks.budget import dense_linear_size, largest_rank, layout_size, size_target
from comera.ranks.truncate import round_, rounds_exactly

SPECIAL = ("dense", "narrow", "comera", "spectrum", "early")
#: The methods whose ranks change as they train: no one clock gives their steps.
ADAPTIVE = ("comera", "spectrum", "early")

#: The engine's kind for a run of a LAYER_KINDS kind (the engine takes formats only): a run of
#: gated layers, as the formats' at a fixed rank.
ENGINE_KIND = "lowrank"

__all__ = ["ADAPTIVE", "ENGINE_KIND", "SPECIAL", "Study", "adaptive_formats", "build",
           "check_method", "engine_kind", "head_of", "is_adaptive", "kind_title",
           "method_names", "narrow_sizes", "split_method", "width_sizes"]


def build(task, kind: str, rank: int | None = None, **sizes: int) -> torch.nn.Module:
    """``task.build(kind, rank, **sizes)``; for a :data:`LAYER_KINDS` kind (``"cola"``), the
    causal LM task's model with block layers of that kind, built here since tasks take formats
    only (a ConfigError for another task)."""
    if kind not in LAYER_KINDS:
        return task.build(kind, rank, **sizes)
    if not isinstance(task, LMTask):
        raise ConfigError(f"method {kind!r} runs on the causal LM task (lm_frontier) only; "
                          f"task {task.name!r} builds its layers from formats.")
    config = replace(task.config, **sizes) if sizes else task.config
    return CausalLM(replace(config.model_config(task.vocab, DENSE, rank), linear=kind))


def engine_kind(kind: str) -> str:
    """The engine's ``format`` for a run of layers of ``kind`` (:data:`ENGINE_KIND` for a
    :data:`LAYER_KINDS` kind)."""
    return ENGINE_KIND if kind in LAYER_KINDS else kind


def kind_title(kind: str) -> str:
    """A format's or layer kind's title (``"TT-matrix"``, ``"CoLA"``), with its options
    (``"block tensor train + zero-init outputs + core RMS <= 2x init"``)."""
    kind, options = split_options(kind)
    return _title(kind) + options_title(options)


def _title(kind: str) -> str:
    if kind in LAYER_KINDS:
        return {"cola": "CoLA (B silu(A x))"}.get(kind, kind)
    return get_format(kind).title


def adaptive_formats() -> tuple[str, ...]:
    """The formats CoMERA trains rank-adaptively (``"comera@<format>"``): every registered
    layer format with a bond to prune (read from its layout at small modes and rank 2)."""
    out = []
    for name in layer_formats():
        if name == DENSE:
            continue
        fmt = get_format(name)
        modes = (2, 2) if fmt.uses_modes else (4,)
        if fmt.layout(modes, modes, 2).bonds:
            out.append(name)
    return tuple(out)


def method_names() -> tuple[str, ...]:
    """Every method a study may run: the special ones, every layer format, every layer format
    at each parametrization (``"tt:plain"``), and CoMERA on every format that trains
    rank-adaptively (``"comera@btt"``, ``"comera@btt:balanced"``)."""
    formats = [f for f in layer_formats() if f != DENSE] + list(LAYER_KINDS)
    on = [f"comera@{f}" for f in adaptive_formats()]
    scaled = (*formats, "comera", *on)
    return (*SPECIAL, *formats, *on, *(f"{f}:{p}" for f in scaled for p in PARAMETRIZATIONS))


def split_method(name: str) -> tuple[str, str | None, str | None]:
    """(method, format, parametrization) of a method name: ``"comera@btt:balanced"`` is
    ("comera", "btt", "balanced"), ``"tt:plain"`` ("tt", None, "plain"), ``"dense"`` ("dense",
    None, None). Not checked: :func:`check_method` does."""
    head, colon, parametrization = name.partition(":")
    base, at, fmt = head.partition("@")
    return base, (fmt if at else None), (parametrization if colon else None)


def head_of(name: str) -> str:
    """A method name without its options: ``"btt+zero:balanced"`` is ``"btt:balanced"``."""
    base, _, parametrization = name.partition(":")
    head = base.partition("+")[0]
    return f"{head}:{parametrization}" if parametrization else head


def is_adaptive(name: str) -> bool:
    """Whether method ``name`` (a row's, ``"comera@btt:plain early"`` too) changes its ranks as
    it trains (:data:`ADAPTIVE`)."""
    return split_method(name.partition(" ")[0])[0] in ADAPTIVE


def check_method(name: str) -> str:
    """``name`` if it is a method a study runs (:func:`method_names`), else a
    :class:`ConfigError` saying what is wrong with it and naming the choices."""
    if not isinstance(name, str):
        raise ConfigError(f"method {name!r}; give a method name such as 'dense' or 'btt'.")
    base, fmt, parametrization = split_method(name)
    if parametrization is not None:
        check_parametrization(parametrization)
    if "+" in name.partition(":")[0]:
        kind, options = split_options(base if fmt is None else f"{base}@{fmt}")
        if kind not in layer_formats() or kind == DENSE or fmt is not None:
            raise ConfigError(f"method {name!r}: options ('+{base.partition('+')[2]}') go on a "
                              f"layer format at a fixed rank (e.g. btt+zero:balanced), not on "
                              f"{head_of(name)!r}.")
        if "cores" in options and not get_format(kind).uses_modes:
            raise ConfigError(f"method {name!r}: the {kind} format uses no modes, so "
                              "'cores<D>' has nothing to set; drop it.")
        return name
    if fmt is not None:
        if base != "comera":
            raise ConfigError(f"method {name!r}: only comera takes a format after '@' "
                              f"(comera@btt); {base!r} names its layers itself.")
        choices = ", ".join(adaptive_formats())
        if fmt not in format_names() and fmt != DENSE:
            raise ConfigError(f"method {name!r}: {fmt!r} is not a registered format; CoMERA "
                              f"trains rank-adaptively on {choices} (e.g. comera@btt:balanced).")
        if fmt not in adaptive_formats():
            why = ("dense layers have no ranks to prune" if fmt == DENSE else
                   f"the {fmt} format builds no layer with ranks to prune from modes")
            raise ConfigError(f"method {name!r}: {why}; CoMERA trains rank-adaptively on "
                              f"{choices}.")
    elif name not in method_names():
        if base in SPECIAL:
            raise ConfigError(f"method {name!r}: {base} takes no parametrization; give "
                              f"{base!r}.")
        kinds = [f for f in layer_formats() if f != DENSE] + list(LAYER_KINDS)
        raise ConfigError(f"method {name!r}; choose dense, narrow, comera, spectrum, early, a "
                          f"layer format or kind ({', '.join(kinds)})"
                          f", either with ':<parametrization>' ("
                          f"{', '.join(PARAMETRIZATIONS)}), or comera@<format>.")
    return name


@dataclass(frozen=True)
class Study:
    """One study's task and settings: ``config`` is the engine's (batch, learning rates,
    warm-up, schedule, optimizer, evaluation, threads); ``steps`` every model's steps,
    ``early`` CoMERA's early steps, ``decide`` the spectrum's, ``lam`` the early stage's,
    ``max_rank`` the starting TT rank; runs go to ``work`` (the engine's run folder)."""

    task: Any
    config: EngineConfig
    work: Path
    steps: int
    early: int = 0
    decide: int = 0
    lam: float = 0.0
    max_rank: int = 16
    floor: str = "uniform"
    early_landing: float = 0.5
    resume: bool = False
    steps_of: Callable[[str, float | None], int] | None = None  # (method, target) -> steps
    evals: int = 8  # with steps_of: evaluations per run, one at every 1 / evals of it
    comera_start: float | None = None  # comera@<format>: the early model's compression, at least
    widths: tuple[int, ...] = ()  # narrow: dense at these d_model widths instead of the targets'

    def __post_init__(self) -> None:
        if not 0 <= self.early < self.steps or not 0 <= self.decide < self.steps:
            raise ConfigError(f"early={self.early}, decide={self.decide} with steps="
                              f"{self.steps}: each is a step count below steps.")
        if self.comera_start is not None and not (
                isinstance(self.comera_start, int | float) and self.comera_start > 1):
            raise ConfigError(f"comera_start={self.comera_start!r}; give the early model's "
                              "compression against dense, a number above 1 (or None: the "
                              "largest rank that compresses at all).")
        for width in self.widths:
            self.width_sizes(width)

    # -- the engine --------------------------------------------------------------------------
    def config_for(self, seed: int, lr: float, steps: int, **changes: Any) -> EngineConfig:
        """The engine's settings of one model: a single stage of ``steps`` (lam 0) unless
        ``changes`` say otherwise."""
        return replace(self.config, **{"seed": seed, "lr": lr, "stage": "early",
                                       "steps_early": steps, "steps_late": 0, "lam": 0.0,
                                       **changes})

    def budget_config(self, method: str, target: float | None, seed: int,
                      lr: float) -> EngineConfig:
        """A dense, narrow or fixed-rank model's settings: all ``steps``, or with ``steps_of``
        the steps its clock buys, evaluated at every ``1 / evals`` of them."""
        if self.steps_of is None:
            return self.config_for(seed, lr, self.steps)
        steps = self.steps_of(method, target)
        return self.config_for(seed, lr, steps, eval_every=steps // self.evals)

    def run(self, name: str, format: str, config: EngineConfig, build=None,
            start_step: int = 0):
        return train(self.task, name, engine_kind(format), config, self.work, build, start_step,
                     self.resume)

    # -- budgets -----------------------------------------------------------------------------
    def shapes(self) -> list[tuple[int, int, bool]]:
        """(in, out, bias) of the dense model's block layers."""
        with torch.random.fork_rng(devices=[]):
            return layer_shapes(self.task.block_linears(self.task.build(DENSE)))

    def budget(self, target: float) -> float:
        """Block-layer parameters at ``target``: dense / target."""
        return dense_linear_size(self.shapes()) / target

    def uniform_rank(self, fmt: str, target: float) -> int:
        """The largest uniform rank at which the block layers of the task's ``fmt`` model hold
        at most dense / target parameters (their modes read from the model built at rank 1;
        0 when not even rank 1 fits)."""
        return self._largest_rank(fmt, self.budget(target))

    def _largest_rank(self, fmt: str, budget: float) -> int:
        kind = split_options(fmt)[0]
        with torch.random.fork_rng(devices=[]):
            probe = self.task.block_linears(build(self.task, kind, 1, **self.option_sizes(fmt)))
        # each layer's own format (a Format instance): CoLA's factors are no registered format
        layers = [(m.format, m.in_modes, m.out_modes, m.bias.numel() if m.bias is not None else 0)
                  for _, m in probe]
        return largest_rank(lambda r: sum(layout_size(f, i, o, r) + b for f, i, o, b in layers),
                            budget)

    def start_rank(self, fmt: str) -> int:
        """The uniform rank CoMERA's early model in ``fmt`` starts at: the largest whose block
        layers hold fewer parameters than dense (with ``comera_start``: at most dense /
        comera_start), and at most ``max_rank``. A ConfigError when not even rank 1 does."""
        if self.comera_start is None:
            rank = self._largest_rank(fmt, dense_linear_size(self.shapes()) - 1)
        else:
            rank = self.uniform_rank(fmt, self.comera_start)
        if rank < 1:
            at = ("compresses" if self.comera_start is None
                  else f"compresses {self.comera_start:g}x")
            raise ConfigError(f"comera@{fmt}: not even rank 1 of the {fmt} model {at}; start "
                              f"lower (comera_start / --comera-start) or use another format.")
        return min(self.max_rank, rank)

    def width_sizes(self, width: int) -> dict[str, int]:
        """:func:`width_sizes` of the task's model."""
        return width_sizes(self.task.config, width)

    def runs_of(self, name: str, targets) -> list[tuple[str, float | None]]:
        """(row method, target) of each model method ``name`` trains on a step budget (what a
        clock must time at equal wall-clock): none for the adaptive methods, none for a format
        at a target where not even rank 1 fits."""
        check_method(name)
        base, _, _ = split_method(name)
        if base in ADAPTIVE:
            return []
        if name == "dense":
            return [("dense", None)]
        if name == "narrow":
            if self.widths:
                return [(f"dense@{w}", None) for w in self.widths]
            return [("narrow", t) for t in targets]
        return [(name, t) for t in targets if self.uniform_rank(base, t) >= 1]

    # -- the methods -------------------------------------------------------------------------
    def dense(self, seed: int, lr: float) -> dict:
        name = _name("dense", None, seed, lr)
        model, record = self.run(name, DENSE, self.budget_config("dense", None, seed, lr),
                                 lambda: self.task.build(DENSE))
        return row(self.task, model, record, seed=seed, method="dense", target=None, lr=lr)

    def fixed(self, fmt: str, target: float, seed: int, lr: float,
              method: str | None = None, parametrization: str | None = None) -> dict | None:
        """``fmt`` at the largest uniform rank within the target (None when rank 1 is over),
        its layers at ``parametrization`` (default: the task's)."""
        rank = self.uniform_rank(fmt, target)
        if rank < 1:
            return None
        kind, options = split_options(fmt)
        sizes = {} if parametrization is None else {"parametrization": parametrization}
        name = _name(method or fmt, target, seed, lr)
        model, record = self.run(name, kind, self.budget_config(fmt, target, seed, lr),
                                 lambda: self.with_options(build(
                                     self.task, kind, rank, **sizes, **self.option_sizes(fmt)),
                                     options))
        extra = {"options": options} if options else {}
        return row(self.task, model, record, seed=seed, method=method or fmt, target=target,
                   lr=lr, rank=rank, format=kind, **extra)

    def option_sizes(self, kind: str) -> dict[str, int]:
        """The task model's sizes the options of ``kind`` change (:func:`.options.option_sizes`)."""
        return option_sizes(split_options(kind)[1])

    def with_options(self, model: torch.nn.Module, options: dict[str, Any]) -> torch.nn.Module:
        """``model`` (just built) changed as ``options`` say (:func:`.options.apply_options`)."""
        return apply_options(self.task, model, options)

    def whole_budget(self, target: float) -> float:
        """Parameters of the whole compressed model at ``target``: the dense model's, with its
        block layers at dense / target."""
        with torch.random.fork_rng(devices=[]):
            total = sum(p.numel() for p in self.task.build(DENSE).parameters())
        return total - dense_linear_size(self.shapes()) + self.budget(target)

    def narrow(self, target: float, seed: int, lr: float) -> dict:
        sizes = narrow_sizes(self.task, self.whole_budget(target), whole=True)
        model, record = self.run(_name("narrow", target, seed, lr), DENSE,
                                 self.budget_config("narrow", target, seed, lr),
                                 lambda: self.task.build(DENSE, **sizes))
        out = row(self.task, model, record, seed=seed, method="narrow", target=target, lr=lr,
                  **sizes)
        dense = dense_linear_size(self.shapes())  # against the wide dense model it stands for
        return out | {"linear_dense": dense, "compression": dense / out["linear_params"]}

    def width(self, width: int, seed: int, lr: float) -> dict:
        """The dense model at d_model ``width`` (:meth:`width_sizes`), all its steps: a point of
        the dense frontier, named ``"dense@<width>"``."""
        sizes = self.width_sizes(width)
        method = f"dense@{width}"
        model, record = self.run(_name(method, None, seed, lr), DENSE,
                                 self.budget_config(method, None, seed, lr),
                                 lambda: self.task.build(DENSE, **sizes))
        out = row(self.task, model, record, seed=seed, method=method, target=None, lr=lr,
                  **sizes)
        dense = dense_linear_size(self.shapes())
        return out | {"linear_dense": dense, "compression": dense / out["linear_params"]}

    def comera(self, targets, seed: int, lr: float, method: str = "comera",
               parametrization: str | None = None, fmt: str | None = None) -> list[dict]:
        """The early model (its own row, ``method + " early"``), then one late stage per
        target; its layers at ``parametrization`` (default: the task's). ``fmt``: the format
        (``"comera@<fmt>"``, started at :meth:`start_rank`); None: TT at ``max_rank``, the
        ``"comera"`` method as the frontiers ran it (its rows as they were), unless
        ``comera_start`` is set."""
        late = self.steps - self.early
        sizes = {} if parametrization is None else {"parametrization": parametrization}
        legacy = fmt is None
        fmt = fmt or "tt"
        self.check_comera(fmt, targets, method)
        rank = self.max_rank if legacy and self.comera_start is None else self.start_rank(fmt)
        extra = {} if legacy else {"format": fmt, "start_rank": rank,
                                   "exact_rounding": rounds_exactly(get_format(fmt))}
        run = method if legacy else f"{method}-r{rank}"  # another start: another checkpoint
        name = _name(f"{run}-early", None, seed, lr)
        early, record = self.run(name, fmt, self.config_for(seed, lr, self.early, lam=self.lam),
                                 lambda: self.task.build(fmt, rank, **sizes))
        round_(early)  # exact where the format has it: frees slices a small neighbour wastes
        rows = [row(self.task, early, record, seed=seed, method=f"{method} early", target=None,
                    lr=lr, **extra)]
        for target in targets:
            config = replace(self.config_for(seed, lr, self.early, lam=self.lam), stage="both",
                             steps_late=late, late_target_loss=0.0, target_compression=target)
            model, record = self.run(_name(run, target, seed, lr), fmt, config,
                                     lambda: copy.deepcopy(early), start_step=self.early)
            rows.append(row(self.task, model, record, seed=seed, method=method, target=target,
                            lr=lr, late_allocation=config.late_allocation,
                            late_landing=config.late_landing, **extra))
        return rows

    def check_comera(self, fmt: str, targets, method: str = "comera") -> None:
        """A ConfigError, before any training, when CoMERA on ``fmt`` cannot run: the late
        stage's allocation does not run on it (``"spectrum"`` reads tensor-train chains only),
        a target lies below the format's smallest model (every rank 1), or (started from
        :meth:`start_rank`) not even rank 1 compresses."""
        if self.config.late_allocation == "spectrum":
            try:
                check_chain_format(fmt)
            except ConfigError as exc:
                raise ConfigError(f"method {method!r} with late_allocation='spectrum' "
                                  f"(--late-allocation): {exc}") from None
        over = [t for t in targets if self.uniform_rank(fmt, t) < 1]
        if over:
            raise ConfigError(f"method {method!r} at {', '.join(f'{t:g}x' for t in over)}: the "
                              f"{fmt} model's block layers at rank 1 everywhere hold more than "
                              "dense / target; choose a smaller target or another format.")
        self.start_rank(fmt)

    def spectrum(self, targets, seed: int, lr: float, method: str = "spectrum") -> list[dict]:
        """Decide the shape on a briefly trained model, then train that shape from the start."""
        probe, record = self.run(_name(f"{method}-decide", None, seed, lr), "tt",
                                 self.config_for(seed, lr, self.decide),
                                 lambda: self.task.build("tt", self.max_rank))
        rows = []
        for target in targets:
            chosen = allocate(probe, size_target(probe, target), self.floor)
            model, rec = self.run(_name(method, target, seed, lr), "tt",
                                  self.config_for(seed, lr, self.steps),
                                  lambda ranks=chosen.ranks: rebuild_at_(
                                      self.task.build("tt", self.max_rank), ranks))
            rows.append(row(self.task, model, rec, seed=seed, method=method, target=target,
                            lr=lr, decide=self.decide, floor=self.floor,
                            uniform_rank=chosen.uniform_rank,
                            decide_seconds=round(record.train_seconds, 1)))
        return rows

    def early_stage(self, target: float, seed: int, lr: float) -> dict:
        """The early stage alone, lam adapted toward the size target."""
        config = self.config_for(seed, lr, self.steps, lam=self.lam, early_target=target,
                                 early_landing=self.early_landing)
        model, record = self.run(_name("early", target, seed, lr), "tt", config,
                                 lambda: self.task.build("tt", self.max_rank))
        return row(self.task, model, record, seed=seed, method="early", target=target, lr=lr)

    def method(self, name: str, targets, seed: int, lr: float) -> list[dict]:
        """The rows of method ``name`` (see the module docstring) at ``targets``."""
        check_method(name)
        if self.steps_of is not None and is_adaptive(name):
            raise ConfigError(f"method {name!r} at equal wall-clock: its step time changes as "
                              "its ranks fall, so no one clock gives its steps; run it without "
                              "the clock budget.")
        if name == "dense":
            return [self.dense(seed, lr)]
        if name in ("comera", "spectrum"):
            return getattr(self, name)(targets, seed, lr)
        if name == "narrow":
            if self.widths:
                return [self.width(w, seed, lr) for w in self.widths]
            return [self.narrow(t, seed, lr) for t in targets]
        if name == "early":
            return [self.early_stage(t, seed, lr) for t in targets]
        base, fmt, parametrization = split_method(name)
        if base == "comera":
            return self.comera(targets, seed, lr, name, parametrization, fmt)
        return [r for t in targets
                if (r := self.fixed(base, t, seed, lr, name, parametrization)) is not None]


def _name(method: str, target: float | None, seed: int, lr: float) -> str:
    """A model's run name in the work folder (its checkpoint's file name)."""
    at = "" if target is None else f"-{target:g}x"
    return f"{method}{at}-s{seed}-lr{lr:g}"


def narrow_sizes(task, budget: float, whole: bool = False) -> dict[str, int]:
    """``d_model`` and ``d_ff`` of the narrower dense model: the largest d_model (a multiple of
    the heads, d_ff at the task's ratio) that fits ``budget``, then the largest d_ff that still
    fits (the same architecture, as many parameters as the budget allows). ``budget`` counts
    the block layers' parameters, or with ``whole`` the whole model's (token table, norms and
    all: what a user compares). ``task.config`` has d_model, d_ff, n_heads and n_layers."""
    c = task.config
    with torch.random.fork_rng(devices=[]):
        bias = any(b for _, _, b in layer_shapes(task.block_linears(task.build(DENSE))))
        rest = _rest_sizes(task) if whole else (lambda d: 0)
    ratio = c.d_ff / c.d_model

    def size(d: int, f: int) -> int:  # per block: q, k, v, o (d x d), ffn_in, ffn_out
        return rest(d) + c.n_layers * (4 * (d * d + bias * d) + (d * f + bias * f)
                                       + (f * d + bias * d))

    d = max((k * c.n_heads for k in range(1, c.d_model // c.n_heads + 1)
             if size(k * c.n_heads, max(1, round(k * c.n_heads * ratio))) <= budget), default=0)
    if d == 0:
        raise ConfigError(f"a budget of {budget:.0f} block parameters is below the narrowest "
                          f"dense model (d_model {c.n_heads}); choose a smaller target.")
    f = math.floor(((budget - rest(d)) / c.n_layers - 4 * (d * d + bias * d) - bias * d)
                   / (2 * d + bias))
    assert size(d, f) <= budget < size(d, f + 1)
    return {"d_model": d, "d_ff": f}


def width_sizes(config, width: int) -> dict[str, int]:
    """``d_model`` and ``d_ff`` of the dense model at d_model ``width``: d_ff at the ratio of
    ``config`` (a task's: d_model, d_ff, n_heads), rounded, the heads dividing ``width``. A
    ConfigError naming the fix when they do not, or when ``width`` is ``config``'s own d_model
    (that model is the ``"dense"`` method)."""
    c = config
    if isinstance(width, bool) or not isinstance(width, int) or width < 1 or width % c.n_heads:
        near = (max(1, round(width / c.n_heads)) * c.n_heads
                if isinstance(width, int | float) else c.n_heads)
        raise ConfigError(f"width {width!r}: a d_model is a positive multiple of the "
                          f"{c.n_heads} heads (e.g. {near}).")
    if width == c.d_model:
        raise ConfigError(f"width {width} is the task's own d_model: that model is the "
                          "'dense' method; drop it from the widths.")
    return {"d_model": width, "d_ff": max(1, round(width * c.d_ff / c.d_model))}


def _rest_sizes(task):
    """d_model -> parameters of the task's dense model outside its block layers (token and
    position tables, norms: linear in d_model, read off two built models)."""
    def rest(d: int) -> int:
        model = task.build(DENSE, d_model=d, d_ff=d)
        blocks = sum(p.numel() for _, m in task.block_linears(model) for p in m.parameters())
        return sum(p.numel() for p in model.parameters()) - blocks

    step = task.config.n_heads
    low, high = rest(step), rest(2 * step)
    return lambda d: low + (high - low) * (d - step) // step
