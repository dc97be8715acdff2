"""The format protocol and the list of registered formats.

A format turns (in_modes, out_modes, ranks) into a :class:`~comera.formats.layout.Layout`, and
says, where it can, how to initialise its cores from a dense weight, how to round them exactly,
and how it holds an embedding table (:attr:`Format.table`). What a format can do is read from
the hooks it defines, one way: it has a decomposition (and then calibrates) iff it defines
:meth:`Format.plain_decomposition`, bond spectra iff it defines :meth:`Format.bond_spectra`. The
base class owns calibration: :meth:`Format.decompose` and :meth:`Format.spectra` run the
format's plain hook, or with a ``gram`` the whitened path around that same hook
(:mod:`comera.formats.whitened`), so no format tests for a gram. Everything else (gates, sizes,
regularisers, pruning, truncation, conversion, checkpoints, reports, embedding lookups) is
generic over the layout. Adding a format is its module (a subclass of :class:`Format`) plus one
line in :data:`BUILTIN` below (or :func:`register_format` for a user's own), and its test; the
lists of formats the rest of comera reads are derived from the registry: :func:`format_names`,
:func:`layer_formats` (a layer's kind: ``"dense"`` or a format), :func:`table_formats`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

from torch import Tensor

import tncomp
from comera.errors import ConfigError
from comera.formats.layout import Layout
from comera.formats.whitened import calibrated_decomposition, whitened_weight

Ranks = int | Sequence[int]
DENSE = "dense"  # a layer's kind when it is a plain dense layer (no format)


class Format:
    """What a weight format says about itself. Subclasses set ``name`` (the registry key, e.g.
    ``"tucker"``) and ``title`` and implement :meth:`layout`; optionally the hooks
    :meth:`plain_decomposition` (then :meth:`decompose` works, plain and calibrated),
    :meth:`bond_spectra` (then :meth:`spectra` does), :attr:`calibrated_starts`,
    :meth:`whitened_spectra` and :meth:`round`."""

    name: str = ""
    title: str = ""
    #: False for formats whose layout ignores modes (plain low-rank): the layer then passes
    #: ``in_modes=(in_features,)`` and ``out_modes=(out_features,)``.
    uses_modes: bool = True
    #: True when :meth:`decompose` is exact at full rank (TT-SVD, HOSVD, SVD, block SVD).
    exact_decomposition: bool = False
    #: False for a declared format (``"einsum"``): its layout is the user's declaration, so
    #: :meth:`layout` from modes and ranks is refused (loops over formats skip it).
    from_modes: bool = True
    #: How the format holds an embedding table: ``""`` in its own layout (rows as inputs, the
    #: dim as outputs: :class:`comera.layers.embedding.GatedEmbedding`), another registered
    #: format's name (TT's tables are TT-matrix tables, ``"ttm"``), or None: it holds none.
    table: str | None = ""
    #: The format's own calibrated starts, tried beside the plain and the Kronecker-whitened
    #: ones (:func:`comera.formats.whitened.calibrated_decomposition`): callables
    #: ``(weight, layout, gram) -> float64 cores``.
    calibrated_starts: tuple[Callable[[Tensor, Layout, Tensor], list[Tensor]], ...] = ()

    @property
    def table_format(self) -> str | None:
        """The registered format an embedding table of this format is held in (None: none)."""
        if self.table is None or not self.from_modes:
            return None
        return self.table or self.name

    @property
    def has_decomposition(self) -> bool:
        """Whether the format defines :meth:`plain_decomposition` (else :meth:`decompose` gives
        None and a layer keeps its random initialisation)."""
        return _defines(self, "plain_decomposition")

    @property
    def calibrates(self) -> bool:
        """Whether :meth:`decompose` takes a ``gram``: every format with a decomposition does
        (the whitened path wraps it)."""
        return self.has_decomposition

    @property
    def has_spectra(self) -> bool:
        """Whether the format defines :meth:`bond_spectra` (global rank allocation needs it)."""
        return _defines(self, "bond_spectra")

    def layout(self, in_modes: tuple[int, ...], out_modes: tuple[int, ...],
               ranks: Ranks) -> Layout:
        """The layer's network for these modes and ranks (an int: every bond at that rank,
        capped where a larger rank is useless; a sequence: one rank per bond)."""
        raise NotImplementedError

    def network(self, layout: Layout) -> tncomp.Network:
        """The tncomp network of the layer (the layout's, unless the format has its own)."""
        return layout.network()

    def plain_decomposition(self, weight: Tensor, layout: Layout) -> list[Tensor]:
        """The hook: cores for ``weight`` (in_features x out_features) at ``layout``'s bond
        sizes (or smaller), minimising the weight's error; in ``weight``'s dtype."""
        raise NotImplementedError

    def bond_spectra(self, weight: Tensor, layout: Layout) -> tuple[Tensor, ...]:
        """The hook: per bond (gate order), the singular values (float64, descending) whose
        squares are what cutting that bond of ``weight``'s decomposition discards."""
        raise NotImplementedError

    def whitened_spectra(self, weight: Tensor, layout: Layout,
                         gram: Tensor) -> tuple[Tensor, ...]:
        """:meth:`bond_spectra` of the Kronecker-whitened weight
        (:func:`~comera.formats.whitened.whitened_weight`), whose squares estimate output-error
        energies; a format with a sharper estimate for some bonds overrides it."""
        return self.bond_spectra(whitened_weight(weight, layout, gram), layout)

    def decompose(self, weight: Tensor, layout: Layout,
                  gram: Tensor | None = None) -> list[Tensor] | None:
        """Cores for ``weight`` (in_features x out_features) at ``layout``'s bond sizes (or
        smaller: the layer shrinks to what the decomposition found), or None when the format
        has no decomposition (the layer keeps its random initialisation). ``gram``: the layer's
        input second moments ``X^T X / n`` (in x in, damped); given, the cores minimise the
        error of the layer's output on those inputs instead of the weight's
        (:func:`comera.formats.whitened.calibrated_decomposition` around
        :meth:`plain_decomposition`)."""
        if not self.has_decomposition:
            return None
        if gram is None:
            return self.plain_decomposition(weight, layout)
        return calibrated_decomposition(self, weight, layout, gram,
                                        starts=self.calibrated_starts)

    def spectra(self, weight: Tensor, layout: Layout,
                gram: Tensor | None = None) -> tuple[Tensor, ...] | None:
        """Per bond (gate order), the singular values (float64, descending) whose squares are
        what cutting that bond of ``weight``'s decomposition discards, slice by slice; with
        ``gram`` (damped input second moments), of the whitened weight
        (:meth:`whitened_spectra`), so the squares are output-error energies. None when the
        format has no such spectra (global rank allocation then refuses it)."""
        if not self.has_spectra:
            return None
        if gram is None:
            return self.bond_spectra(weight, layout)
        return self.whitened_spectra(weight, layout, gram)

    def dense(self, cores: list[Tensor], layout: Layout) -> Tensor:
        """The dense weight (in_features x out_features) of ``cores``: the layout's
        contraction, unless the format has its own order of operations (TT's)."""
        return layout.dense(cores)

    def round(self, cores: list[Tensor], layout: Layout) -> list[Tensor] | None:
        """The same weight at the smallest exact bond sizes (float64 cores in, float64 out,
        bonds possibly smaller), or None when the format has no exact rounding."""
        return None

    def __repr__(self) -> str:
        return f"<format {self.name}>"


def _defines(fmt: Format, hook: str) -> bool:
    """Whether ``fmt``'s class overrides the base class's ``hook``: the one way a capability
    is declared."""
    return getattr(type(fmt), hook) is not getattr(Format, hook)


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
