"""A task's config holds its model's config (nanoGPT's one ``GPTConfig``), so each model size is
declared once, on the model config.

    LMTaskConfig(model=CausalLMConfig(d_model=256), seq_len=128)  # nested: the primary form
    LMTaskConfig(d_model=256, seq_len=128)                        # the same config, flat
    config.d_model                                                # reads config.model.d_model
    dataclasses.replace(config, d_model=512)                      # replaces it in the model

:func:`holds_model` makes a frozen dataclass with a field ``model`` (its default: the task's
default model config) take the model config's fields as flat keywords too, which override the
given (or default) model's. Flat keywords are a kept convenience, not deprecated: the run scripts
and tests read and vary sizes by name. A config pickled when the sizes were fields of the task
config itself loads as the nested config it describes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import MISSING, fields, is_dataclass, replace
from typing import Any, TypeVar

from comera.errors import ConfigError
from comera.numbers import is_int

__all__ = ["check_corpus_settings", "config_keywords", "holds_model"]

C = TypeVar("C")


def holds_model(*, follows: Mapping[str, str] | None = None,
                not_flat: tuple[str, ...] = ()) -> Callable[[type[C]], type[C]]:
    """Class decorator for a frozen dataclass task config whose field ``model`` holds its model
    config. Every field of the model config but ``not_flat`` (fields the task chooses itself,
    e.g. the layer kind of each build) and the keys of ``follows`` becomes a flat keyword of the
    constructor and a read-only attribute. ``follows``: model field -> task field it always
    equals (the model's ``max_len`` is the task's ``seq_len``), set after the task's own checks.
    """
    follows = dict(follows or {})

    def wrap(cls: type[C]) -> type[C]:
        slot = {f.name: f for f in fields(cls)}.get("model")
        if slot is None or slot.default is MISSING or not is_dataclass(slot.default):
            raise TypeError(f"{cls.__name__}: holds_model needs a field `model` whose default "
                            "is the task's default model config.")
        default = slot.default
        kind = type(default)
        names = tuple(f.name for f in fields(kind)
                      if f.name not in not_flat and f.name not in follows)
        own = {f.name for f in fields(cls)}
        clash = set(names) & own
        if clash or not set(follows.values()) <= own:
            raise TypeError(f"{cls.__name__}: fields {sorted(clash)} are also the model's, or "
                            f"follows {follows} names a field it lacks.")
        init = cls.__init__
        signature = inspect.signature(init)

        @functools.wraps(init)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            flat = {name: kwargs.pop(name) for name in names if name in kwargs}
            bound = signature.bind(self, *args, **kwargs)  # TypeError for an unknown keyword
            model = bound.arguments.get("model", default)
            if not isinstance(model, kind):
                raise ConfigError(f"model={model!r}; give a {kind.__name__} (or its fields as "
                                  f"keywords, e.g. {cls.__name__}(d_model=256)).")
            if flat:
                bound.arguments["model"] = replace(model, **flat)
            init(*bound.args, **bound.kwargs)
            _follow(self)

        def _follow(self: Any) -> None:
            want = {m: getattr(self, t) for m, t in follows.items()}
            if any(getattr(self.model, m) != v for m, v in want.items()):
                object.__setattr__(self, "model", replace(self.model, **want))

        def __setstate__(self: Any, state: dict[str, Any]) -> None:
            """A pickle of before the task config held its model config (its sizes flat)
            loads as the nested config it describes."""
            state = dict(state)
            if "model" not in state:
                flat = {name: state.pop(name) for name in names if name in state}
                state["model"] = replace(default, **flat)
            self.__dict__.update(state)
            _follow(self)

        cls.__init__ = __init__  # type: ignore[method-assign]
        cls.__setstate__ = __setstate__  # type: ignore[attr-defined]
        cls.flat_keywords = frozenset(names)  # type: ignore[attr-defined]
        for name in names:
            setattr(cls, name, property(functools.partial(_read, name=name),
                                        doc=f"``model.{name}`` (a flat read)."))
        return cls

    return wrap


def _read(self: Any, name: str) -> Any:
    return getattr(self.model, name)


def config_keywords(config_class: type) -> frozenset[str]:
    """Every keyword ``config_class`` takes: its fields and, for a config that holds its model
    config (:func:`holds_model`), the model's flat ones."""
    return (frozenset(f.name for f in fields(config_class))
            | getattr(config_class, "flat_keywords", frozenset()))


def check_corpus_settings(seq_len: int, eval_limit: int | None, eval_batch_size: int,
                          unit: str) -> None:
    """The settings the corpus tasks' configs share: ``seq_len`` (a row holds [CLS], tokens and
    [SEP]), ``eval_limit`` (``unit`` of val/test scored, or None for whole splits) and
    ``eval_batch_size``; else a ConfigError naming the value, before the model's checks see
    ``seq_len`` as its ``max_len``."""
    if eval_limit is not None and not is_int(eval_limit):
        raise ConfigError(f"eval_limit={eval_limit!r}; give a number of {unit} >= 1, "
                          "or None to score whole splits.")
    if not is_int(eval_batch_size):
        raise ConfigError(f"eval_batch_size={eval_batch_size!r}; it must be an int >= 1.")
    if not is_int(seq_len, 3):
        raise ConfigError(f"seq_len={seq_len!r}; a row holds [CLS], tokens and [SEP], "
                          "so seq_len >= 3.")
