"""The format protocol and the list of registered formats.

A format turns (in_modes, out_modes, ranks) into a :class:`~comera.formats.layout.Layout`, and
says, where it can, how to initialise its cores from a dense weight, how to round them exactly,
and how it holds an embedding table (:attr:`Format.table`). Everything else (gates, sizes,
regularisers, pruning, truncation, conversion, checkpoints, reports, embedding lookups) is
generic over the layout. Adding a format is its module (a subclass of :class:`Format`) plus one
line in :data:`BUILTIN` below (or :func:`register_format` for a user's own), and its test; the
lists of formats the rest of comera reads are derived from the registry: :func:`format_names`,
:func:`layer_formats` (a layer's kind: ``"dense"`` or a format), :func:`table_formats`.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from torch import Tensor

import tncomp
from comera.errors import ConfigError
from comera.formats.layout import Layout

Ranks = int | Sequence[int]
DENSE = "dense"  # a layer's kind when it is a plain dense layer (no format)


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
    #: How the format holds an embedding table: ``""`` in its own layout (rows as inputs, the
    #: dim as outputs: :class:`comera.layers.embedding.GatedEmbedding`), another registered
    #: format's name (TT's tables are TT-matrix tables, ``"ttm"``), or None: it holds none.
    table: str | None = ""

    @property
    def table_format(self) -> str | None:
        """The registered format an embedding table of this format is held in (None: none)."""
        if self.table is None or not self.from_modes:
            return None
        return self.table or self.name

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
        ``calibrates``; :mod:`comera.formats.whitened`)."""
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


def table_formats() -> tuple[str, ...]:
    """The registered formats that hold embedding tables (a table of each is held in its
    :attr:`Format.table_format`): derived from the registry, there is no other list."""
    return tuple(name for name, fmt in _registry().items() if fmt.table_format is not None)


def layer_formats() -> tuple[str, ...]:
    """What a layer's kind may be: ``"dense"`` or a registered format built from modes (a
    declared one, ``"einsum"``, has no layer without its equation)."""
    return (DENSE, *(name for name, fmt in _registry().items() if fmt.from_modes))


def check_layer_format(value: str, what: str = "format") -> str:
    """``value`` as a layer's kind (:func:`layer_formats`), else a :class:`ConfigError` naming
    it and the choices."""
    if not isinstance(value, str) or value not in layer_formats():
        raise ConfigError(f"{what}={value!r}; choose one of {', '.join(layer_formats())}.")
    return value


def register_format(fmt: Format) -> Format:
    """Add ``fmt`` (a user's own format, say) to the registry under ``fmt.name``."""
    if not isinstance(fmt, Format) or not fmt.name:
        raise ConfigError(f"register_format takes a Format instance with a name, got {fmt!r}.")
    _registry()[fmt.name] = fmt
    return fmt
