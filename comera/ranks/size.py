"""Model size S(model) at the effective ranks, and compression ratios.

S counts every parameter the model would ship with after truncation: the cores of every gated
layer (TT, TT-matrix or any format) at their effective ranks, as the layer's layout counts them
(:meth:`comera.formats.layout.Layout.parameters_at`; a layer with an all-zero gate counts as
removed), every other parameter, biases included. Gates fold into the cores, so they do not
count. The dense size replaces each gated layer by the dense matrix it stands for.

A hot-row cache (:class:`~comera.layers.cached_embedding.CachedTTEmbedding`) counts with its TT
table: its rows add to the table's size (and so to ``model_size(model, only=TTEmbedding)``), and not
to the dense size, where they are rows of the plain table already.

This is the one count: ``compression_ratio``, the run summary (``tt_params``, ``model_params``)
and ``comera report`` (:mod:`comera.surgery.report`, which reads a checkpoint without the model)
all state sizes this way.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from comera.layers.cached_embedding import CachedTTEmbedding
from comera.layers.linear import GatedLayer, bond_ranks_of
from tncomp.extend import renamed


def gated_layers(model: nn.Module) -> Iterator[tuple[str, GatedLayer]]:
    """Every gated layer (:class:`~comera.layers.linear.GatedLayer`: TT, TT-matrix or any
    format) of ``model`` with its qualified name."""
    for name, module in model.named_modules():
        if isinstance(module, GatedLayer):
            yield name, module


#: ``tt_modules``, the name of :func:`gated_layers` before every format shared it: warned until
#: 0.3.0.
__getattr__ = renamed(__name__, {"tt_modules": (f"{__name__}:gated_layers", "0.3.0")})


def _caches(model: nn.Module) -> dict[int, int]:
    """id(TT table) -> parameters of its hot-row cache."""
    return {id(m.tt): m.cache.numel() for m in model.modules()
            if isinstance(m, CachedTTEmbedding)}


def _non_tt_parameters(model: nn.Module) -> int:
    inside = {id(p) for _, m in gated_layers(model) for p in m.parameters()}
    inside |= {id(m.cache) for m in model.modules() if isinstance(m, CachedTTEmbedding)}
    return sum(p.numel() for p in model.parameters() if id(p) not in inside)


def model_size(model: nn.Module, effective: bool = True, only: type | None = None) -> int:
    """S(model): TT layers at effective ranks (with their hot-row caches) plus every other
    parameter.

    ``only``: count just the TT layers of this type (e.g. ``TTLinear``) and nothing else.
    """
    caches = _caches(model)
    layers = [m for _, m in gated_layers(model) if only is None or isinstance(m, only)]
    counted = ([m.parameters_at_ranks(r) for m, r in zip(layers, bond_ranks_of(layers),
                                                          strict=True)]
               if effective else [m.num_parameters(False) for m in layers])
    tt = sum(n + caches.get(id(m), 0) for m, n in zip(layers, counted, strict=True))
    return tt if only is not None else tt + _non_tt_parameters(model)


def dense_size(model: nn.Module, only: type | None = None) -> int:
    """The size of the same model with every TT layer dense."""
    tt = sum(m.dense_num_parameters() for _, m in gated_layers(model)
             if only is None or isinstance(m, only))
    return tt if only is not None else tt + _non_tt_parameters(model)


def layers_size(model: nn.Module, layers) -> tuple[int, int]:
    """(parameters at the effective ranks, with their hot-row caches; dense parameters) of the
    gated ``layers`` of ``model``, counted as :func:`model_size` and :func:`dense_size` do."""
    caches = _caches(model)
    layers = list(layers)
    return (sum(m.num_parameters() + caches.get(id(m), 0) for m in layers),
            sum(m.dense_num_parameters() for m in layers))


def compression_ratio(model: nn.Module, only: type | None = None) -> float:
    """Dense size / effective size (of the TT layers of type ``only``, if given)."""
    return dense_size(model, only) / max(model_size(model, True, only), 1)
