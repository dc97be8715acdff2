"""The format protocol and the list of registered formats.

A format turns (in_modes, out_modes, ranks) into a :class:`~comera.formats.layout.Layout`, and
says, where it can, how to initialise its cores from a dense weight and how to round them
exactly. Everything else (gates, sizes, regularisers, pruning, truncation, conversion,
checkpoints, reports) is generic over the layout. Adding a format is its module (a subclass of
:class:`Format`) plus one line in :data:`FORMATS` below, and its test.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from torch import Tensor

import tncomp
from comera.errors import ConfigError
from comera.formats.layout import Layout

Ranks = int | Sequence[int]


class Format:
    """What a weight format says about itself. Subclasses set ``name`` (the registry key, e.g.
    ``"tucker"``) and ``title`` and implement :meth:`layout`; the rest is optional."""

    name: str = ""
    title: str = ""
    #: False for formats whose layout ignores modes (plain low-rank): the layer then passes
    #: ``in_modes=(in_features,)`` and ``out_modes=(out_features,)``.
    uses_modes: bool = True
    #: True when :meth:`decompose` is exact at full rank (TT-SVD, HOSVD, SVD, block SVD).
    exact_decomposition: bool = False
    #: True when :meth:`decompose` takes a ``gram`` (calibrated decomposition).
    calibrates: bool = False
    #: False for a declared format (``"einsum"``): its layout is the user's declaration, so
    #: :meth:`layout` from modes and ranks is refused (loops over formats skip it).
    from_modes: bool = True

    def layout(self, in_modes: tuple[int, ...], out_modes: tuple[int, ...],
               ranks: Ranks) -> Layout:
        """The layer's network for these modes and ranks (an int: every bond at that rank,
        capped where a larger rank is useless; a sequence: one rank per bond)."""
        raise NotImplementedError

    def network(self, layout: Layout) -> tncomp.Network:
        """The tncomp network of the layer (the layout's, unless the format has its own)."""
        return layout.network()

    def decompose(self, weight: Tensor, layout: Layout,
                  gram: Tensor | None = None) -> list[Tensor] | None:
        """Cores for ``weight`` (in_features x out_features) at ``layout``'s bond sizes (or
        smaller: the layer shrinks to what the decomposition found), or None when the format
        has no closed form (the layer keeps its random initialisation). ``gram``: the layer's
        input second moments ``X^T X / n`` (in x in, damped); given, the cores minimise the
        error of the layer's output on those inputs instead of the weight's (formats with
        ``calibrates``; :mod:`comera.formats.calibrated`)."""
        return None

    def spectra(self, weight: Tensor, layout: Layout,
                gram: Tensor | None = None) -> tuple[Tensor, ...] | None:
        """Per bond (gate order), the singular values (float64, descending) whose squares are
        what cutting that bond of ``weight``'s decomposition discards, slice by slice; with
        ``gram`` (damped input second moments), of the whitened weight, so the squares are
        output-error energies. None when the format has no such spectra (global rank allocation
        then refuses it)."""
        return None

    def round(self, cores: list[Tensor], layout: Layout) -> list[Tensor] | None:
        """The same weight at the smallest exact bond sizes (float64 cores in, float64 out,
        bonds possibly smaller), or None when the format has no exact rounding."""
        return None

    def __repr__(self) -> str:
        return f"<format {self.name}>"


#: The built-in formats, one line each: "module:class". Imported on first use.
BUILTIN: tuple[str, ...] = (
    "comera.formats.tt:TT",
    "comera.formats.tt:TTM",
    "comera.formats.tucker:Tucker",
    "comera.formats.cp:CP",
    "comera.formats.lowrank:LowRank",
    "comera.formats.tensor_ring:TensorRing",
    "comera.formats.btt:BlockTT",
    "comera.formats.einsum:Declared",
)

FORMATS: dict[str, Format] = {}
_builtin_loaded = False


def _registry() -> dict[str, Format]:
    """:data:`FORMATS`, with the built-in formats imported on the first call."""
    global _builtin_loaded
    if not _builtin_loaded:
        for entry in BUILTIN:
            module, cls = entry.split(":")
            fmt = getattr(importlib.import_module(module), cls)()
            FORMATS.setdefault(fmt.name, fmt)
        _builtin_loaded = True
    return FORMATS


def get_format(name: str | Format) -> Format:
    """The registered format called ``name`` (a :class:`Format` passes through), else a
    :class:`ConfigError` naming the choices."""
    if isinstance(name, Format):
        return name
    formats = _registry()
    if not isinstance(name, str) or name not in formats:
        raise ConfigError(f"format={name!r}; choose one of {', '.join(sorted(FORMATS))} (or "
                          "declare a network with GatedLinear.from_eq).")
    return FORMATS[name]


def format_names() -> tuple[str, ...]:
    """The registered formats' names."""
    return tuple(_registry())


def register_format(fmt: Format) -> Format:
    """Add ``fmt`` (a user's own format, say) to the registry under ``fmt.name``."""
    if not isinstance(fmt, Format) or not fmt.name:
        raise ConfigError(f"register_format takes a Format instance with a name, got {fmt!r}.")
    _registry()[fmt.name] = fmt
    return fmt
