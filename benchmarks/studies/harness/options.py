"""Options of a study's format method, after ``+`` (``"btt+zero+rms2:balanced"``): each one a
change to the model the format builds, made by a library option, so a study can screen the
training directions of a format against the format itself on one grid.

- ``zero``: each residual branch's output layer (:data:`RESIDUAL_OUTPUTS`) starts at zero
  (:func:`comera.layers.zero_init.zero_output_`: its last core).
- ``rms`` / ``rms<F>``: every core bounded to F times its initial RMS (F = 1 by default) after
  each step (:func:`comera.training.core_rms.keep_core_rms_bounded`, a hook before each
  training forward: the engine builds its own optimizer).
- ``cbs``: each core read under the structure-aware multipliers of Qiu et al. 2024
  (:func:`comera.formats.scaling.structure_aware_multipliers`; the same effective cores, so only
  the steps change).
- ``cores<D>``: the layers built with D modes per side (BTT: D cores), the uniform rank then read
  at that order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from comera.errors import ConfigError
from comera.formats.scaling import structure_aware_multipliers
from comera.layers.zero_init import zero_output_
from comera.ranks.size import gated_layers
from comera.training.core_rms import check_factor, keep_core_rms_bounded

__all__ = ["OPTIONS", "RESIDUAL_OUTPUTS", "apply_options", "option_sizes", "options_title",
           "split_options"]

#: The options by prefix, and what each does.
OPTIONS = {"zero": "each residual branch's output layer starts at zero (its last core)",
           "rms": "every core at most its initial RMS (rms<F>: F times it) after each step",
           "cbs": "each core's step at Qiu et al. 2024's structure-aware rate (muP per core)",
           "cores": "cores<D>: the layers built with D modes per side (BTT: D cores)"}
#: The block layers that end a residual branch, by the end of their names (the causal LM's and
#: the transformer's attention output and FFN output layers).
RESIDUAL_OUTPUTS = ("attn.o", "ffn_out")

_TITLES = {"zero": lambda v: "zero-init outputs", "cbs": lambda v: "muP rate per core",
           "rms": lambda v: f"core RMS <= {v:g}x init", "cores": lambda v: f"{v} modes per side"}


def split_options(kind: str) -> tuple[str, dict[str, Any]]:
    """(kind, options) of a method's kind with options: ``"btt+zero+rms2"`` is ("btt",
    {"zero": True, "rms": 2.0}), ``"btt+cores2"`` ("btt", {"cores": 2}); ``"rms"`` alone is a
    factor of 1. A ConfigError for an option it does not know or a bad number."""
    kind, *given = kind.split("+")
    options: dict[str, Any] = {}
    for text in given:
        key = next((k for k in OPTIONS if text.startswith(k)), None)
        value = text[len(key):] if key else ""
        try:
            if key in ("zero", "cbs") and not value:
                parsed: Any = True
            elif key == "rms":
                parsed = check_factor(float(value) if value else 1.0)
            elif key == "cores" and value.isdigit() and int(value) >= 2:
                parsed = int(value)
            else:
                raise ValueError(text)
        except (ValueError, ConfigError):
            raise ConfigError(
                f"method option {text!r} (in {'+'.join([kind, *given])!r}); choose zero, cbs, "
                "rms or rms<F> (F > 0, e.g. rms2), cores<D> (D >= 2, e.g. cores2).") from None
        if key in options:
            raise ConfigError(f"method option {key!r} given twice in "
                              f"{'+'.join([kind, *given])!r}; give it once.")
        options[key] = parsed
    return kind, options


def options_title(options: dict[str, Any]) -> str:
    """What ``options`` add to a format's title (``" + zero-init outputs"``)."""
    return "".join(f" + {_TITLES[k](v)}" for k, v in options.items())


def option_sizes(options: dict[str, Any]) -> dict[str, int]:
    """The task model's sizes ``options`` change (``cores<D>``: ``tt_order``)."""
    return {"tt_order": options["cores"]} if "cores" in options else {}


def apply_options(task, model: nn.Module, options: dict[str, Any]) -> nn.Module:
    """``model`` of ``task`` (just built) changed as ``options`` say; ``cores`` is a size, given
    to the build instead (:func:`option_sizes`). A ConfigError when ``zero`` finds no residual
    output layer among the task's block layers."""
    if options.get("zero"):
        layers = task.block_linears(model)
        ends = [m for n, m in layers if n.endswith(RESIDUAL_OUTPUTS)]
        if not ends:
            raise ConfigError(f"option 'zero': none of the block layers "
                              f"{[n for n, _ in layers][:6]} ends with {RESIDUAL_OUTPUTS}; this "
                              "task's model names its residual output layers otherwise.")
        for layer in ends:
            zero_output_(layer)
    if options.get("cbs"):  # the same effective cores, read under other multipliers
        with torch.no_grad():
            for _, layer in gated_layers(model):
                cores = [c.detach().clone() for c in layer.effective_cores()]
                layer.set_core_scales_(structure_aware_multipliers(layer.layout))
                for core, value, scale in zip(layer.cores, cores, layer.core_scale_values,
                                              strict=True):
                    core.copy_(value / scale)
    if "rms" in options:
        keep_core_rms_bounded(model, options["rms"])
    return model
