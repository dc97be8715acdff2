"""Calibration: each layer's input second moments, streamed over a model's forward passes.

``convert_(model, config, calibration=batches)`` runs the model (eval mode, no gradients) on each
batch with forward hooks on the modules it is about to convert, and accumulates per distinct
input ``X^T X`` and the row count ``n``, so a calibrated decomposition
(:mod:`comera.formats.whitened`) minimises the error of the layer's output on those inputs.

**One statistic per distinct input.** Layers fed the same tensor (q, k and v of one hidden
state; a gated MLP's gate and up projections) share one accumulation: the hooks see the tensor
itself, and a layer whose input is a tensor another layer already took in this batch joins that
layer's statistic (the same :class:`InputStats` object comes back for both). Should two layers
that shared stop sharing in a later batch, the statistic is split exactly then (a shared
statistic keeps its batch's input tensors alive until the batch ends, to recompute them).

**No finite input overflows or underflows.** Each batch's rows are scaled by a power of two
(exact) so their largest entry is below 1, their product taken in float32 (float64 for
float64 inputs: float16 and bfloat16 rows are widened first), and summed in float64 against a
per-statistic power-of-two exponent. A layer whose activations are 1e20 or 1e-25 gets the same
relative precision as one at 1.0. :attr:`InputStats.moments` is the scaled second-moment matrix
(what every calibrated decomposition reads: they do not depend on its scale),
:attr:`InputStats.gram` the unscaled one.

**Memory is stated and bounded before the first statistic exists.** A statistic is a float64
``in x in`` matrix (:func:`gram_bytes`), whatever the number of batches. Before the first batch
the collector states (log, info) the most it will hold (one per layer); over ``limit`` it first
runs the first batch with hooks that only see which layers share an input, and refuses with a
:class:`~comera.errors.ConfigError` if the shared statistics are still over the limit
(``ConvertConfig.statistics_memory``). Running out of memory in a forward is its own error.

A batch is whatever the model's forward takes: a tensor (``model(x)``), a mapping of keyword
arguments (``model(**batch)``, as HuggingFace models take a tokenizer's output) or a tuple or
list of positional arguments (``model(*batch)``); tensors inside are moved to the model's
device. An empty iterable, a batch the model rejects (a mapping's keys are named) or inputs
that are not finite raise :class:`~comera.errors.ConfigError` before any layer is replaced, and
the model's modes (train / eval) are restored whatever happens.

Which input feeds which layer: a linear module's (``nn.Linear``, HuggingFace ``Conv1D``) first
argument; an ``nn.MultiheadAttention``'s ``query``, ``key`` and ``value`` for its split q, k and v
projections (all three, averaged, for the packed ``in_proj``; one tensor passed as all three is
counted once). Its ``out_proj`` never runs as a module (the attention reads its weight
directly), so it has no statistics and is decomposed plainly.
"""

from __future__ import annotations

import difflib
import inspect
import itertools
import logging
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from comera.batches import to_device
from comera.errors import ConfigError
from comera.surgery.converters import IN_PARTS

log = logging.getLogger("comera.surgery.input_statistics")

__all__ = ["InputStats", "check_batches", "collect_input_stats", "gram_bytes", "input_width",
           "run_batch", "statistics_bytes"]


@dataclass(frozen=True)
class InputStats:
    """One input's calibration statistics: ``moments = X^T X / rows / 4**exponent`` (in x in,
    float64, scaled so that no finite input overflows or underflows it), the number of input
    rows (tokens) seen and the power-of-two ``exponent``. Layers fed one tensor share one."""

    moments: Tensor
    rows: int
    exponent: int = 0

    @property
    def gram(self) -> Tensor:
        """``X^T X / rows`` itself (float64; inputs beyond ~1e154 overflow it: read
        :attr:`moments`, which calibrated decompositions use, for those)."""
        return _times_power_of_two(self.moments, 2 * self.exponent)


def _times_power_of_two(t: Tensor, k: int) -> Tensor:
    """``t * 2**k`` for a float64 ``t``, exact (unless the result leaves float64's range), in
    steps a float64 power of two holds."""
    while k:
        step = max(-1000, min(1000, k))
        t = t * 2.0**step
        k -= step
    return t


def _product(x: Tensor) -> tuple[Tensor, int, int]:
    """``(X^T X / 4**e, e, n)`` of a layer input's rows ``X`` (n, in): the rows scaled by
    ``2**-e`` (exact) so their largest entry is in [0.5, 1), their product in float32 (float64
    for float64 rows), returned in float64."""
    rows = x.detach().reshape(-1, x.shape[-1])  # (n, in)
    peak = float(rows.abs().max()) if rows.numel() else 0.0
    e = math.frexp(peak)[1] if peak > 0 else 0
    scaled = _times_power_of_two(rows.to(torch.float64), -e)  # (n, in), entries below 1
    if rows.dtype != torch.float64:  # float32 / float16 / bfloat16 values: exact in float32
        scaled = scaled.to(torch.float32)
    return (scaled.T @ scaled).to(torch.float64), e, rows.shape[0]  # (in, in)


class _Accumulator:
    """``X^T X`` of one input, as a float64 ``sum`` times ``4**exponent``, and its row count."""

    def __init__(self, name: str, width: int):
        self.name, self.width = name, width
        self.sum: Tensor | None = None  # (in, in), made at the first input
        self.exponent = 0
        self.rows = 0
        self.batch: list[tuple[int, Tensor]] = []  # while shared: (token, input) this batch
        self.tokens: set[int] = set()  # the tokens of the inputs added in this batch

    def add(self, product: tuple[Tensor, int, int], sign: int = 1) -> None:
        p, e, n = product
        if self.sum is None:
            self.sum, self.exponent = p.clone() * sign, e
        elif e > self.exponent:  # rescale the sum (exact unless it falls below 2**-1074)
            self.sum = _times_power_of_two(self.sum, 2 * (self.exponent - e))
            self.exponent = e
            self.sum += sign * p
        else:
            self.sum += sign * _times_power_of_two(p, 2 * (e - self.exponent))
        self.rows += sign * n

    def copy(self, name: str) -> _Accumulator:
        out = _Accumulator(name, self.width)
        out.sum = None if self.sum is None else self.sum.clone()
        out.exponent, out.rows = self.exponent, self.rows
        return out

    def stats(self) -> InputStats:
        return InputStats(self.sum / max(self.rows, 1), self.rows, self.exponent)


def gram_bytes(features: Iterable[int]) -> int:
    """Bytes the input statistics of inputs of these widths hold (float64 squares)."""
    return sum(8 * n * n for n in features)


def statistics_bytes(stats: Mapping[str, InputStats]) -> int:
    """Bytes ``stats`` hold, each shared statistic counted once."""
    distinct = {id(s.moments): s.moments for s in stats.values()}
    return sum(m.numel() * m.element_size() for m in distinct.values())


def input_width(name: str, module: nn.Module) -> int:
    """The input width of the layer ``name`` whose forward is ``module``'s (an
    ``nn.MultiheadAttention`` part by its suffix); 0 when the module does not say."""
    if isinstance(module, nn.MultiheadAttention):
        part = name.rpartition(".")[2]
        return {"k_proj": module.kdim, "v_proj": module.vdim}.get(part, module.embed_dim)
    width = getattr(module, "in_features", None)
    if isinstance(width, int):
        return width
    weight = getattr(module, "weight", None)  # HF's Conv1D holds (in, out)
    return int(weight.shape[0]) if isinstance(weight, Tensor) and weight.dim() == 2 else 0


def check_batches(batches: Any) -> Iterable:
    """``batches`` if it is an iterable of batches, else a :class:`ConfigError` saying how to
    pass one (a lone tensor or mapping would be iterated row by row or key by key)."""
    if isinstance(batches, Tensor):
        raise ConfigError(f"calibration is one tensor of shape {tuple(batches.shape)}; pass an "
                          "iterable of batches, e.g. calibration=[x] or x.split(32).")
    if isinstance(batches, Mapping | str | bytes):
        raise ConfigError(f"calibration is a {type(batches).__name__}; pass an iterable of "
                          "batches, e.g. calibration=[batch] for one batch of keyword "
                          "arguments, or a DataLoader.")
    if not isinstance(batches, Iterable):
        raise ConfigError(f"calibration={batches!r}; pass an iterable of batches (tensors, "
                          "dicts of keyword arguments or tuples of arguments), e.g. a list or "
                          "a DataLoader.")
    return batches


def _out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError | torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


def _keys_hint(model: nn.Module, batch: Mapping) -> str:
    """The keys a mapping batch gave, and those the model's forward does not take."""
    given = list(batch)
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return f" The batch's keys: {given}."
    takes = [n for n, p in params.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in given if k not in takes]
    if not unknown:
        return f" The batch's keys: {given}."
    named = "named " if any(p.kind is p.VAR_KEYWORD for p in params.values()) else ""
    close = {k: difflib.get_close_matches(k, takes, n=1) for k in unknown}
    hints = "".join(f" Did you mean {c[0]!r} for {k!r}?" for k, c in close.items() if c)
    return (f" The batch's keys: {given}; {unknown} are not {named}arguments of "
            f"{type(model).__name__}.forward (it takes {takes[:12]}).{hints}")


def run_batch(model: nn.Module, batch: Any, index: int,
              held: Callable[[], int] = lambda: 0, what: str = "calibration batch") -> Any:
    """One forward of ``model`` on ``batch`` (a tensor: ``model(x)``, a mapping:
    ``model(**batch)``, a tuple or list: ``model(*batch)``), its output returned; whatever it
    raises becomes a ConfigError naming the batch (``what`` and ``index``; the hooks' own
    ConfigErrors pass through); running out of memory says so, with ``held()`` bytes of
    statistics."""
    if not isinstance(batch, Tensor | Mapping | list | tuple):
        raise ConfigError(f"{what} {index} is a {type(batch).__name__}; a batch is a "
                          "tensor, a dict of keyword arguments or a tuple of positional "
                          "arguments.")
    try:
        if isinstance(batch, Tensor):
            return model(batch)
        if isinstance(batch, Mapping):
            return model(**batch)
        return model(*batch)
    except ConfigError as exc:  # a hook's: name the batch
        raise ConfigError(f"{what} {index}: {exc}") from None
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        if _out_of_memory(exc):
            raise ConfigError(f"{what} {index}: out of memory ({type(exc).__name__}: "
                              f"{first[:200]}) with {held() / 2**20:.1f} MiB of input "
                              "statistics held; pass smaller calibration batches, or convert "
                              "fewer layers (include / exclude).") from exc
        hint = _keys_hint(model, batch) if isinstance(batch, Mapping) else ""
        raise ConfigError(f"{what} {index}: the model rejected it ({type(exc).__name__}"
                          f": {first}).{hint} Pass batches the model's forward takes: a tensor "
                          "(model(x)), a dict (model(**batch)) or a tuple (model(*batch)).") \
            from exc


class _Collector:
    """The hooks' state: which statistic each layer adds to, and which tensors each took in
    the current batch (by identity: a token per tensor, tracked through a weak reference so a
    freed tensor's reused id is never taken for it)."""

    def __init__(self, widths: Mapping[str, int], probe: bool = False):
        self.widths = dict(widths)
        self.probe = probe  # only see who shares: no statistic is made
        self.owner: dict[str, _Accumulator] = {}
        self.seen: dict[int, tuple[weakref.ref, int, _Accumulator | None]] = {}
        self.consumed: dict[str, set[int]] = {}
        self.counter = itertools.count()
        self.fresh: set[int] = set()  # accumulators made in this batch (ids)
        self.first: dict[str, int] = {}  # probe: the token of each layer's first input

    def begin_batch(self) -> None:
        self.seen.clear()
        self.consumed = {name: set() for name in self.owner}
        self.fresh.clear()

    def take(self, name: str, x: Any) -> None:
        width = self.widths.get(name) or None
        acc = self.owner.get(name)
        have = acc.sum.shape[0] if acc is not None and acc.sum is not None else width
        if not isinstance(x, Tensor) or x.dim() == 0 or have not in (None, x.shape[-1]):
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ConfigError(f"layer {name!r} received an input of shape {shape}; it takes "
                              f"(..., {have or 'features'}).")
        ref = self.seen.get(id(x))
        known = ref is not None and ref[0]() is x
        token = ref[1] if known else next(self.counter)
        if self.probe:
            if not known:
                self.seen[id(x)] = (weakref.ref(x), token, None)
            self.first.setdefault(name, token)
            return
        if not known and not bool(torch.isfinite(x).all()):
            raise ConfigError(f"the inputs of layer {name!r} hold NaN or infinite values; "
                              "check the calibration batches (and the model's earlier "
                              "layers).")
        self.consumed.setdefault(name, set()).add(token)
        other = ref[2] if known else None
        if acc is None:  # the layer's first input: join the statistic that took it this batch
            if other is not None and id(other) in self.fresh and other.tokens == {token}:
                self.owner[name] = other
                other.batch = [(token, x)]
                return
            acc = self.owner[name] = _Accumulator(name, x.shape[-1])
            self.fresh.add(id(acc))
        if token in acc.tokens:
            return  # this statistic already holds this tensor
        acc.add(_product(x))
        acc.tokens.add(token)
        if self.shared(acc):
            acc.batch.append((token, x))
        if not known:
            self.seen[id(x)] = (weakref.ref(x), token, acc)

    def shared(self, acc: _Accumulator) -> bool:
        return sum(a is acc for a in self.owner.values()) > 1

    def end_batch(self) -> None:
        """Split a shared statistic whose layers took different tensors in this batch: each
        set of layers that took the same tensors gets the statistic before this batch plus
        its own tensors (the products are recomputed from the tensors this batch held)."""
        by_acc: dict[int, list[str]] = {}
        for name, acc in self.owner.items():
            by_acc.setdefault(id(acc), []).append(name)
        for names in by_acc.values():
            acc = self.owner[names[0]]
            classes: dict[frozenset[int], list[str]] = {}
            for name in names:
                classes.setdefault(frozenset(self.consumed.get(name, ())), []).append(name)
            if len(names) > 1 and list(classes) != [frozenset(acc.tokens)]:
                self._split(acc, classes)
            acc.batch, acc.tokens = [], set()

    def _split(self, acc: _Accumulator, classes: dict[frozenset[int], list[str]]) -> None:
        inputs = dict(acc.batch)
        before = acc.copy(acc.name)
        for x in inputs.values():
            before.add(_product(x), sign=-1)
        if before.rows == 0:  # nothing before this batch: start clean, not from a residue
            before = _Accumulator(acc.name, acc.width)
        for held, names in classes.items():
            if held == frozenset(acc.tokens):
                continue  # these layers keep the statistic as it is
            part = before.copy(names[0])
            for token in sorted(held):
                part.add(_product(inputs[token]))
            for name in names:
                self.owner[name] = part
        log.info("calibration: layers %s took different inputs in one batch; their statistic "
                 "was split", sorted(n for names in classes.values() for n in names))

    def held(self) -> int:
        distinct = {id(a): a for a in self.owner.values() if a.sum is not None}
        return sum(a.sum.numel() * 8 for a in distinct.values())

    def shared_widths(self) -> list[int]:
        """Probe: the width of each statistic the first batch makes (layers whose first input
        is one tensor share one)."""
        out: dict[int, int] = {}
        for name, token in self.first.items():
            out.setdefault(token, self.widths.get(name, 0))
        return list(out.values())


def _attention_taps(name: str, packed: bool):
    """The hook of an nn.MultiheadAttention: its query / key / value into the q / k / v
    statistics (all three into ``in_proj`` when packed)."""
    parts = ("in_proj",) * 3 if packed else IN_PARTS
    names = [f"{name}.{p}" for p in parts]

    def tap(collector: _Collector, args: tuple, kwargs: dict) -> None:
        values = [args[k] if len(args) > k else kwargs.get(key)
                  for k, key in enumerate(("query", "key", "value"))]
        for part, x in zip(names, values, strict=True):
            if part in collector.widths:
                collector.take(part, x)
    return tap


def _linear_tap(name: str):
    def tap(collector: _Collector, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else next(iter(kwargs.values()), None)
        collector.take(name, x)
    return tap


def _hooked(model: nn.Module, layers: Mapping[str, nn.Module], packed: bool,
            collector: _Collector) -> list:
    taps: dict[nn.Module, Callable] = {}
    for name, module in layers.items():
        if isinstance(module, nn.MultiheadAttention):
            owner = name.rpartition(".")[0]
            taps.setdefault(module, _attention_taps(owner, packed))
        else:
            taps[module] = _linear_tap(name)
    return [module.register_forward_pre_hook(
        lambda _m, args, kwargs, tap=tap: tap(collector, args, kwargs), with_kwargs=True)
        for module, tap in taps.items()]


def _then(box: list, rest: Iterator) -> Iterator:
    """The batch in ``box`` (taken out, so nothing else keeps it alive), then ``rest``."""
    yield box.pop()
    yield from rest


def _passes(model: nn.Module, layers: Mapping[str, nn.Module], batches: Iterator,
            packed: bool, collector: _Collector, device: torch.device,
            progress: Callable[[int], None] | None) -> int:
    """Run every batch of ``batches`` with ``collector``'s hooks on; the number of batches."""
    handles = _hooked(model, layers, packed, collector)
    count = 0
    try:
        with torch.no_grad():
            for count, batch in enumerate(batches, 1):
                collector.begin_batch()
                run_batch(model, to_device(batch, device), count - 1, collector.held)
                collector.end_batch()
                if progress is not None:
                    progress(count)
    finally:
        for handle in handles:
            handle.remove()
    return count


def _check_memory(model: nn.Module, layers: Mapping[str, nn.Module], widths: dict[str, int],
                  first: Any, packed: bool, device: torch.device, limit: int | None) -> None:
    """State the most the statistics will hold; over ``limit``, probe the first batch for
    inputs that layers share and refuse if the shared statistics are still over it."""
    most = gram_bytes(widths.values())
    log.info("calibration: %d layer(s), at most %.1f MiB of input statistics (less where layers "
             "share an input)%s", len(widths), most / 2**20,
             "" if limit is None else f"; limit {limit / 2**20:.1f} MiB")
    if limit is None or most <= limit:
        return
    probe = _Collector(widths, probe=True)
    handles = _hooked(model, layers, packed, probe)
    try:
        with torch.no_grad():
            probe.begin_batch()
            run_batch(model, to_device(first, device), 0)
    finally:
        for handle in handles:
            handle.remove()
    need = gram_bytes(probe.shared_widths())
    if need > limit:
        widest = sorted(widths.items(), key=lambda kv: -kv[1])[:3]
        raise ConfigError(
            f"calibration needs {need / 2**20:,.1f} MiB of input statistics (a float64 in x in "
            f"matrix per distinct input of {len(widths)} layer(s), widest "
            f"{', '.join(f'{n} ({w})' for n, w in widest)}), over statistics_memory="
            f"{limit:,} bytes ({limit / 2**20:,.1f} MiB). Raise statistics_memory (e.g. "
            f"ConvertConfig(statistics_memory={2 ** math.ceil(math.log2(need))})), or convert "
            "fewer layers at a time (include / exclude).")
    log.info("calibration: %.1f MiB of input statistics once shared inputs are counted once",
             need / 2**20)


def collect_input_stats(model: nn.Module, layers: Mapping[str, nn.Module], batches: Iterable,
                        packed_attention: bool = False,
                        progress: Callable[[int], None] | None = None,
                        limit: int | None = None
                        ) -> tuple[dict[str, InputStats], int]:
    """Per layer name, the :class:`InputStats` of its inputs over ``batches`` (layers fed one
    tensor share one object), and the number of batches.

    ``layers``: the layer names to calibrate -> the module whose forward receives the input (a
    part of an ``nn.MultiheadAttention``, ``<name>.q_proj`` ..., maps to the attention module).
    ``progress``: called with the number of batches done after each one. ``limit``: the most
    bytes the statistics may hold (None: no limit), checked before the first statistic is
    made. Layers no batch reached are left out (they are decomposed plainly)."""
    batches = iter(check_batches(batches))
    box = [next(batches, _EMPTY)]  # the first batch, held until the passes take it
    if box[0] is _EMPTY:
        raise ConfigError("calibration gave no batches (an empty iterable); pass at least one "
                          "batch of inputs, e.g. calibration=[x].")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    widths = {name: input_width(name, module) for name, module in layers.items()}
    collector = _Collector(widths)
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        _check_memory(model, layers, widths, box[0], packed_attention, device, limit)
        count = _passes(model, layers, _then(box, batches), packed_attention, collector, device,
                        progress)
    finally:
        for module, training in modes.items():
            module.training = training
    unseen = sorted(name for name in layers if name not in collector.owner
                    or collector.owner[name].rows == 0)
    if unseen:
        log.warning("calibration: no input reached %s; decomposed without calibration",
                    ", ".join(unseen))
    made = {id(a): a.stats() for a in collector.owner.values() if a.rows > 0}
    stats = {name: made[id(a)] for name, a in collector.owner.items() if id(a) in made}
    log.info("calibration: %d batch(es), %d statistic(s) for %d layer(s), %.1f MiB", count,
             len(made), len(stats), statistics_bytes(stats) / 2**20)
    return stats, count


_EMPTY = object()
