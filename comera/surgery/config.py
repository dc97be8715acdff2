"""``ConvertConfig``: what ``convert_`` converts and how, validated when it is built (every bad
field a :class:`~comera.errors.ConfigError` naming it), as PEFT's tuner configs are."""

from __future__ import annotations

import difflib
import fnmatch
import json
import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any

from comera.errors import ConfigError
from comera.formats.registry import format_names, get_format
from comera.formats.scaling import DECOMPOSED, check_parametrization
from comera.layers.linear import DEFAULT_TAU, check_memory, check_tau
from comera.numbers import is_int

IN_PROJ = ("split", "packed")
DEFAULT_RANK = 16  # every layer's max rank when neither ranks nor target_compression is given
ALLOCATIONS = ("uniform", "global", "sensitivity")
#: The allocations that spend one size budget across the layers (target_size is theirs).
BUDGETED = ("global", "sensitivity")
#: What keeps a budgeted allocation from losing to uniform's ranks (ConvertConfig's ``floor``).
FLOORS = ("estimate", "measured")
DEFAULT_DAMPING = 1e-2
#: The most memory calibration's input statistics may hold, in bytes (ConvertConfig's
#: ``statistics_memory``): above it ``convert_`` refuses before the first batch.
DEFAULT_STATISTICS_MEMORY = 8 * 2**30


@dataclass(frozen=True)
class ConvertConfig:
    """What to convert and how.

    include / exclude: fnmatch patterns over qualified module names ("*" matches all).
    ranks: a max rank for every layer, or {pattern: max rank}, first match wins (default:
    16 for every layer).
    target_compression: instead of ranks (giving both is refused), the largest uniform max rank
    per layer whose size is at most dense / target (per layer, biases counted on both sides).
    allocation: how a size target is spent. "uniform": per layer, the largest uniform max rank
    whose size is at most the layer's dense size / target. "global": one budget for all the
    linear layers converted (their dense weights / target_compression, or ``target_size``
    parameters), spent bond slice by bond slice where the most truncation error goes per
    parameter (of the output error, with calibration), or the uniform allocation's ranks where
    that spend's estimated error is not lower; see :mod:`comera.ranks.global_budget`.
    "sensitivity": the same budget spent by the model's measured loss when each layer alone is
    decomposed at a few candidate ranks (ASVD's sensitivity), then the measured floor against
    uniform; needs calibration and a loss, as floor="measured" does; parameters no
    candidate's loss asks for stay unspent (:mod:`comera.surgery.sensitivity`). Each refuses
    a target that rank 1 cannot reach, naming the largest that it can.
    target_size: with allocation="global" or "sensitivity", the budget as a number of
    parameters of the linear layers' cores (instead of target_compression).
    damping: with calibration, the fraction of the input second moments' mean diagonal added
    to their diagonal before whitening (regularises directions the inputs rarely visit).
    statistics_memory: with calibration, the most bytes the input statistics may hold (one
    float64 ``in x in`` matrix per distinct layer input); a model that needs more is refused
    before the first batch (None: no limit).
    floor: with allocation="global", what decides between the global spend's ranks and the
    uniform allocation's: "estimate" (the spend's own truncation-error estimate, free) or
    "measured" (the converted model's loss on calibration batches under each, both
    calibrated; needs calibration and a loss, see :func:`comera.surgery.convert.convert_`).
    None (the default): "measured" for allocation="sensitivity" (its only floor: it measures
    losses anyway), else "estimate"; the field holds the resolved value.
    closed_form_refit: with calibration, after each linear layer's decomposition solve its
    output-side cores (low-rank's second factor, TT's output cores, Tucker's output factors)
    in closed form for the least output error on the calibration inputs, one core at a time
    (:func:`comera.formats.whitened.refit_output_cores`; SVD-LLM's layer-wise update).
    """

    include: Sequence[str] = ("*",)
    exclude: Sequence[str] = ()
    linear: bool = True
    embedding: bool = False
    ranks: int | Mapping[str, int] | None = None
    target_compression: float | None = None
    d: int = 3
    tau: float = DEFAULT_TAU
    # the target format of every linear layer (a name of comera.formats.format_names()), or
    # {pattern: format}, first match wins; embedding tables are TT-matrix ("tt" or "ttm")
    format: str | Mapping[str, str] = "tt"
    modes: Mapping[str, tuple[Sequence[int], Sequence[int]]] = field(default_factory=dict)
    # nn.MultiheadAttention's packed q/k/v projection: three TT layers ("split": <name>.q_proj,
    # .k_proj, .v_proj) or one with 3 x embed_dim outputs ("packed": <name>.in_proj)
    attention_in_proj: str = "split"
    # what the TT layers keep for the backward (tncomp's memory option, GatedLayer.memory):
    # "fast", "balanced", "min" or a byte budget per layer call
    memory: str | int = "fast"
    # how the gated linear layers scale their cores (comera.formats.scaling): "plain" (the cores
    # as decomposed; the default, formats.scaling.DECOMPOSED) or "balanced"
    parametrization: str = DECOMPOSED
    allocation: str = "uniform"
    target_size: int | None = None
    damping: float = DEFAULT_DAMPING
    statistics_memory: int | None = DEFAULT_STATISTICS_MEMORY
    floor: str | None = None
    closed_form_refit: bool = False

    def __post_init__(self) -> None:
        check_parametrization(self.parametrization)
        for key in ("include", "exclude"):
            value = getattr(self, key)
            if isinstance(value, str):  # one pattern
                object.__setattr__(self, key, (value,))
            elif not isinstance(value, Sequence | set | frozenset) or any(
                    not isinstance(p, str) for p in value):
                raise ConfigError(f"{key}={value!r}; pass a list of fnmatch patterns over "
                                  f"module names, e.g. {key}=['encoder.*'].")
            else:
                object.__setattr__(self, key, tuple(value))
        for key in ("linear", "embedding", "closed_form_refit"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key}={getattr(self, key)!r}; pass True or False.")
        if self.ranks is not None and self.target_compression is not None:
            raise ConfigError(f"ranks={self.ranks!r} and target_compression="
                              f"{self.target_compression!r}: give one; target_compression "
                              "chooses each layer's rank itself.")
        if self.ranks is None:
            pass
        elif isinstance(self.ranks, Mapping):
            bad = {k: v for k, v in self.ranks.items() if not isinstance(k, str)
                   or not _is_rank(v)}
            if bad or not self.ranks:
                raise ConfigError(f"ranks={dict(self.ranks)!r}; a mapping of fnmatch pattern to "
                                  "a max rank (an int >= 1), e.g. ranks={'*': 16}.")
        elif not _is_rank(self.ranks):
            raise ConfigError(f"ranks={self.ranks!r}; a max rank is an int >= 1 (e.g. ranks=16), "
                              "or a mapping of pattern to rank.")
        if self.target_compression is not None and not (
                _is_number(self.target_compression) and self.target_compression > 1):
            raise ConfigError(f"target_compression={show(self.target_compression)}; it must be "
                              "a finite number > 1 (dense size / TT size), or None to use "
                              "ranks.")
        if not is_int(self.d, 1, 64):
            raise ConfigError(f"d={show(self.d)}; the number of modes per side is an int from 1 "
                              "to 64 "
                              "(a TT layer has at least one mode per side; default 3).")
        check_tau(self.tau)
        _check_format(self.format)
        if not isinstance(self.modes, Mapping) or any(
                not isinstance(k, str) or not _is_modes(v) for k, v in self.modes.items()):
            raise ConfigError(f"modes={self.modes!r}; a mapping of layer name to (in_modes, "
                              "out_modes), each a list of ints >= 1, e.g. "
                              "modes={'fc': ([8, 8], [4, 16])}.")
        if self.attention_in_proj not in IN_PROJ:
            raise ConfigError(f"attention_in_proj={self.attention_in_proj!r}; choose one of "
                              f"{', '.join(IN_PROJ)}.")
        check_memory(self.memory)
        self._check_allocation()
        if not (self.linear or self.embedding):
            raise ConfigError("linear and embedding are both False: nothing would be converted.")

    def _check_allocation(self) -> None:
        if not isinstance(self.allocation, str) or self.allocation not in ALLOCATIONS:
            raise ConfigError(f"allocation={self.allocation!r}; choose one of "
                              f"{', '.join(ALLOCATIONS)}.")
        if self.target_size is not None:
            if not (_is_rank(self.target_size) and _is_number(self.target_size)):
                raise ConfigError(f"target_size={show(self.target_size)}; it is a number of "
                                  "parameters, an int >= 1 that a float holds (or None: use "
                                  "target_compression).")
            if self.allocation not in BUDGETED or self.target_compression is not None:
                raise ConfigError(f"target_size={self.target_size} is the budget of "
                                  "allocation='global' or 'sensitivity' (set one and leave "
                                  "target_compression=None); a uniform allocation takes "
                                  "target_compression.")
        if self.floor is None:
            object.__setattr__(self, "floor", "measured" if self.allocation == "sensitivity"
                               else "estimate")
        if not isinstance(self.floor, str) or self.floor not in FLOORS:
            raise ConfigError(f"floor={self.floor!r}; choose one of {', '.join(FLOORS)}.")
        if self.floor == "measured" and self.allocation == "uniform":
            raise ConfigError("floor='measured' decides between the global (or sensitivity) "
                              "and the uniform allocation's ranks; with allocation='uniform' "
                              "there is nothing to decide. Set allocation='global', or leave "
                              "floor at its default.")
        if self.floor == "estimate" and self.allocation == "sensitivity":
            raise ConfigError("floor='estimate' with allocation='sensitivity': sensitivity "
                              "chooses ranks by the model's measured loss, and its floor "
                              "against uniform is measured too; leave floor at its default "
                              "(None) or set floor='measured'.")
        if self.allocation in BUDGETED and self.target_compression is None and (
                self.target_size is None):
            raise ConfigError(f"allocation={self.allocation!r} spends a size budget across the "
                              "layers: set target_compression (e.g. 2) or target_size "
                              "(parameters).")
        if self.allocation in BUDGETED and self.ranks is not None:
            target = (f"target_size={self.target_size}" if self.target_size is not None
                      else f"target_compression={self.target_compression!r}")
            raise ConfigError(f"ranks={self.ranks!r} and allocation={self.allocation!r} "
                              f"({target}): that allocation chooses every layer's ranks from "
                              "its budget, so ranks would be ignored; drop ranks, or use "
                              "allocation='uniform' with ranks.")
        if not (_is_number(self.damping) and 0 < self.damping < 1e3):
            raise ConfigError(f"damping={show(self.damping)}; it is a finite number in (0, 1000) "
                              "(a fraction of the mean input second moment; default "
                              f"{DEFAULT_DAMPING}).")
        if self.statistics_memory is not None and not (
                _is_rank(self.statistics_memory) and _is_number(self.statistics_memory)):
            raise ConfigError(f"statistics_memory={show(self.statistics_memory)}; it is a number "
                              "of bytes, an int >= 1 (e.g. 16 * 2**30), or None for no limit.")

    def rank_for(self, name: str) -> int:
        """The max rank for the layer named ``name``: ``ranks`` itself, or the value of the first
        pattern in ``ranks`` that matches (a :class:`ConfigError` when none does)."""
        if self.ranks is None:
            return DEFAULT_RANK
        if isinstance(self.ranks, int):
            return self.ranks
        for pattern, rank in self.ranks.items():
            if fnmatch.fnmatchcase(name, pattern):
                return rank
        raise ConfigError(f"no ranks pattern matches layer {name!r}; add one or use '*'.")


    def format_for(self, name: str) -> str:
        """The format of the layer named ``name``: ``format`` itself, or the value of the first
        pattern in ``format`` that matches (a :class:`ConfigError` when none does)."""
        if isinstance(self.format, str):
            return self.format
        for pattern, fmt in self.format.items():
            if fnmatch.fnmatchcase(name, pattern):
                return fmt
        raise ConfigError(f"no format pattern matches layer {name!r} (patterns "
                          f"{list(self.format)}); add one or use '*'.")


def _check_format(value: object) -> None:
    """A registered format's name, or a non-empty {pattern: name} mapping of them."""
    names = [n for n in format_names() if get_format(n).from_modes]
    declared = sorted(set(format_names()) - set(names))
    asked = list(value.values()) if isinstance(value, Mapping) else [value]
    for name in asked:
        if isinstance(name, str) and name in declared:
            raise ConfigError(f"format={name!r} is a declared network, not built from a layer's "
                              "modes, so convert_ cannot make one: build it with "
                              "GatedLinear.from_eq and swap it in, or choose one of "
                              f"{', '.join(names)}.")
    if isinstance(value, str) and value in names:
        return
    if isinstance(value, Mapping) and value and all(
            isinstance(k, str) and isinstance(v, str) and v in names for k, v in value.items()):
        return
    raise ConfigError(f"format={value!r}; choose one of {', '.join(names)}, or map fnmatch "
                      "patterns to them, e.g. format={'encoder.*': 'tt', '*': 'ttm'}.")


def _is_number(value: object) -> bool:
    """A finite int or float that a float holds (an int of 400 digits does not)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def show(value: object) -> str:
    """``repr(value)``, an int too long to read given by its digits instead."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"<an int of {len(str(abs(value)))} digits>"
    return repr(value)


def check_options(options: Mapping[str, Any]) -> None:
    """Keyword options of ``convert_`` name fields of :class:`ConvertConfig`, else a
    :class:`ConfigError` naming the unknown ones (with the closest known name) and listing the
    known names, as ``comera convert --set`` does."""
    known = sorted(f.name for f in dataclass_fields(ConvertConfig))
    unknown = [k for k in options if k not in known]
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
    raise ConfigError(f"unknown convert option(s) {', '.join(hints)}; known: "
                      f"{', '.join(known)}.")


def _is_rank(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_modes(value: object) -> bool:
    return (isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2
            and all(isinstance(side, Sequence) and not isinstance(side, str) and side
                    and all(_is_rank(m) for m in side) for side in value))


def _type_name(hint: Any) -> str:
    """A type hint in words: ``int | Mapping[str, int]`` -> "int or mapping of str to int"."""
    origin, params = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(p) for p in params)
    if hint is type(None):
        return "null"
    if origin in (Mapping, dict) and len(params) == 2:
        return f"mapping of {_type_name(params[0])} to {_type_name(params[1])}"
    if origin in (Sequence, list, tuple):
        return f"list of {_type_name(params[0])}" if params else "list"
    return getattr(hint, "__name__", str(hint))


def _matches(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a field's type hint (hints it does not know pass: the
    dataclass checks those)."""
    origin, params = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, p) for p in params)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (Mapping, dict):
        return isinstance(value, dict) and (len(params) != 2 or all(
            _matches(k, params[0]) and _matches(v, params[1]) for k, v in value.items()))
    if origin in (Sequence, list, tuple):
        if not isinstance(value, list | tuple):
            return False
        if origin is tuple and params and params[-1] is not Ellipsis:
            return len(value) == len(params) and all(
                _matches(v, p) for v, p in zip(value, params, strict=True))
        return not params or all(_matches(v, params[0]) for v in value)
    return True


def _finite(value: Any) -> bool:
    """No NaN or infinity anywhere in a JSON value (json.loads accepts NaN and Infinity)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(_finite(v) for v in value)
    return True


def config_from_json(fields: Mapping[str, Any]) -> ConvertConfig:
    """A :class:`ConvertConfig` from JSON values (``comera convert --config`` / ``--set``):
    unknown names, non-finite numbers and values of the wrong JSON type are each a
    :class:`ConfigError` naming the setting, before the config is built (``include`` /
    ``exclude`` may be one pattern)."""
    fields = dict(fields)
    known = {f.name for f in dataclass_fields(ConvertConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError(f"unknown convert setting(s) {', '.join(unknown)}; known: "
                          f"{', '.join(sorted(known))}.")
    for key in ("include", "exclude"):
        if isinstance(fields.get(key), str):
            fields[key] = (fields[key],)
    hints = typing.get_type_hints(ConvertConfig)
    for key, value in fields.items():
        if not _finite(value):
            raise ConfigError(f"convert setting {key}={json.dumps(value)}: numbers must be "
                              "finite, e.g. --set target_compression=20.")
        if not _matches(value, hints[key]):
            raise ConfigError(f"convert setting {key}={json.dumps(value)}: expected "
                              f"{_type_name(hints[key])}, e.g. --set ranks=16.")
    try:
        return ConvertConfig(**fields)
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"convert settings {json.dumps(fields)} were refused: {exc}") from None


__all__ = ["ALLOCATIONS", "DEFAULT_STATISTICS_MEMORY", "FLOORS", "IN_PROJ", "ConvertConfig",
           "check_options", "config_from_json", "show"]
