"""Layer records: what checkpoints and ``save_pretrained`` folders store per gated layer, and
how a layer is rebuilt from one.

A record is plain data (it goes into JSON). A linear layer of any format:
``{"kind": "GatedLinear", "format": name, "layout": Layout.to_dict(), "bias": bool, "tau": x}``;
a TT-matrix embedding table: ``{"kind": "TTEmbedding", "in_features", "out_features",
"in_modes", "out_modes", "bonds", "tau", "bias", "padding_idx", "merge_pairs"}``; a table in any
other format that holds one: ``{"kind": "GatedEmbedding", "format": name, "layout":
Layout.to_dict(), "num_embeddings": rows, "padding_idx": row or null, "tau": x}`` (the layout's
inputs are the padded rows, its outputs the dim); a CoLA layer (not a format: nonlinear):
``{"kind": "ColaLinear", "in_features", "out_features", "rank", "activation", "bias", "tau"}``.
Records written before the
format protocol (kinds ``"TTLinear"`` / ``"TTMLinear"``: modes and chain bonds) are read as
GatedLinear records of format ``tt`` / ``ttm`` (:func:`upgrade`).

A record read from a file is checked (:func:`read_records`) before anything is built: types and
ranges, a layout the format itself builds at those bond sizes, the layer built on the meta
device (no memory) and every tensor it has present in the file with the same shape. Each record
kind is one :class:`RecordKind` in :data:`KINDS`; nothing else branches on kinds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from comera.errors import CheckpointError, ConfigError
from comera.formats.layout import Layout
from comera.formats.registry import format_names, get_format, table_formats
from comera.layers.classes import linear_class
from comera.layers.cola import ACTIVATIONS, ColaLinear
from comera.layers.embedding import GatedEmbedding, TTEmbedding
from comera.layers.linear import GatedLayer, GatedLinear, check_tau

MAX_FEATURES = 2**31 - 1  # a record's sizes and bonds: int32, checked before anything is built
MAX_MODES = 64
MAX_INDICES = 4 * MAX_MODES  # indices of a recorded layout
LEGACY = {"TTLinear": "tt", "TTMLinear": "ttm"}  # kinds written before the format protocol
LEGACY_KEYS = ("kind", "in_features", "out_features", "in_modes", "out_modes", "bonds", "tau",
               "bias", "padding_idx", "merge_pairs")


# -- checks of plain values -----------------------------------------------------------------------
def _whole(value: Any, low: int = 1, high: int = MAX_FEATURES) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _modes(value: Any) -> bool:
    return (isinstance(value, list | tuple) and 1 <= len(value) <= MAX_MODES
            and all(_whole(m) for m in value))


def _tau_problem(spec: Mapping[str, Any]) -> str | None:
    try:
        check_tau(spec["tau"])  # the layers' one rule: in [0, 1)
    except ConfigError as exc:
        return f"has {exc}"
    return None


def _tau_bias_problem(spec: Mapping[str, Any]) -> str | None:
    if not isinstance(spec["bias"], bool):
        return f"has bias={spec['bias']!r}; expected true or false"
    return _tau_problem(spec)


# -- the kinds ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RecordKind:
    """One kind of record: which layers it describes (``owns``), how it is written (``write``),
    checked (``problem``: what is wrong with a record's values, or None) and built (``build``),
    and which dense module type it stands for (``dense``: the module whose place it takes when
    loaded into an unconverted model; ``fits``: why a dense module cannot be replaced;
    ``switch``: the ConvertConfig flag that converts such modules)."""

    name: str
    owns: Callable[[GatedLayer], bool]
    write: Callable[[GatedLayer], dict[str, Any]]
    problem: Callable[[Mapping[str, Any]], str | None]
    build: Callable[[Mapping[str, Any], dict], GatedLayer]
    dense: type[nn.Module]
    fits: Callable[[nn.Module, Mapping[str, Any]], str | None]
    switch: str


def _linear_write(layer: GatedLayer) -> dict[str, Any]:
    return {"kind": "GatedLinear", "format": layer.format.name,
            "layout": layer.layout.to_dict(), "bias": layer.bias is not None,
            "tau": float(layer.tau)}


def builds_from_modes(fmt_name: str, layout: Layout) -> bool:
    """Whether the format ``fmt_name`` builds layouts from ``layout``'s modes (False for a
    declared network, whose layout is the user's whole description)."""
    fmt = get_format(fmt_name)
    if not fmt.from_modes:
        return False
    try:
        fmt.layout(layout.in_modes, layout.out_modes, 1)
    except (NotImplementedError, ConfigError):
        return False
    return True


def layout_problem(fmt_name: str, layout: Layout) -> str | None:
    """Why ``layout`` is not one the format ``fmt_name`` builds at its own bond sizes (None when
    it is, or when the format builds no layouts from modes: a user-declared network, whose
    layout is the whole description and is computed as it stands)."""
    sizes = [s for _, s in layout.sizes]
    if len(sizes) > MAX_INDICES or len(layout.cores) > MAX_INDICES:
        return f"has a layout of {len(sizes)} indices and {len(layout.cores)} cores"
    if not all(_whole(s) for s in sizes) or not (
            _whole(layout.in_features) and _whole(layout.out_features)):
        return f"has a layout whose sizes pass {MAX_FEATURES}"
    fmt = get_format(fmt_name)
    if not builds_from_modes(fmt_name, layout):
        return None  # no layouts from modes (a declared network): the layout is its network
    try:
        expected = fmt.layout(layout.in_modes, layout.out_modes, list(layout.bond_sizes))
    except ConfigError as exc:
        return f"has bond sizes {layout.bond_sizes} that the {fmt_name} format refuses ({exc})"
    if expected != layout:
        return (f"has a layout that the {fmt_name} format does not build (cores "
                f"{[list(c) for c in layout.cores]} over sizes {dict(layout.sizes)}; the format "
                f"builds cores {[list(c) for c in expected.cores]} over {dict(expected.sizes)})")
    return None


def _format_layout(spec: Mapping[str, Any], keys: tuple[str, ...], formats: tuple[str, ...],
                   held: str) -> tuple[Layout | None, str | None]:
    """A format-and-layout record's layout, or what is wrong with it: a key of ``keys``
    missing, a format outside ``formats`` (``held``: what the error says they are), a layout
    that does not parse or that the format does not build (:func:`layout_problem`)."""
    missing = [k for k in keys if k not in spec]
    if missing:
        return None, f"lacks {', '.join(missing)}"
    if spec["format"] not in formats:
        return None, f"has format {spec['format']!r}; {held} {', '.join(formats)}"
    if not isinstance(spec["layout"], Mapping):
        return None, f"has a layout of type {type(spec['layout']).__name__}, not a mapping"
    try:
        layout = Layout.from_dict(spec["layout"])
    except ConfigError as exc:
        return None, f"has a layout that does not parse ({exc})"
    return layout, layout_problem(spec["format"], layout)


def _linear_problem(spec: Mapping[str, Any]) -> str | None:
    _, why = _format_layout(spec, ("format", "layout", "bias", "tau"), format_names(),
                            "this comera knows")
    return why or _tau_bias_problem(spec)


def _linear_build(spec: Mapping[str, Any], factory: dict) -> GatedLayer:
    return linear_class(spec["format"]).from_layout(
        Layout.from_dict(spec["layout"]), spec["format"], spec["bias"], float(spec["tau"]),
        **factory)


def _linear_fits(module: nn.Module, spec: Mapping[str, Any]) -> str | None:
    layout = Layout.from_dict(spec["layout"])
    if not builds_from_modes(spec["format"], layout):  # its structure is the file's alone
        fmt = get_format(spec["format"])
        return (f"the checkpoint holds a {fmt.title} layer (format {fmt.name!r}), which no "
                f"conversion of an nn.{type(module).__name__} makes, and the model lacks it: "
                "build that layer in the model first (e.g. GatedLinear.from_eq(...), at any "
                "bond sizes: loading resizes it), then load")
    mine = (module.in_features, module.out_features, module.bias is not None)
    theirs = (layout.in_features, layout.out_features, spec["bias"])
    if mine != theirs:
        return f"(in, out, bias) are {mine} in the model, {theirs} in the checkpoint"
    return None


def _embedding_write(layer: TTEmbedding) -> dict[str, Any]:
    return {"kind": "TTEmbedding", "in_features": int(layer.in_features),
            "out_features": int(layer.out_features),
            "in_modes": tuple(int(m) for m in layer.in_modes),
            "out_modes": tuple(int(m) for m in layer.out_modes), "bonds": tuple(layer.bonds),
            "tau": float(layer.tau), "bias": False, "padding_idx": layer.padding_idx,
            "merge_pairs": bool(layer.merge_pairs)}


def _legacy_problem(spec: Mapping[str, Any]) -> str | None:
    """What is wrong with a record of the modes-and-chain-bonds shape (embeddings, and linear
    layers written before the format protocol)."""
    missing = [k for k in LEGACY_KEYS if k not in spec]
    if missing:
        return f"lacks {', '.join(missing)}"
    for key in ("in_features", "out_features"):
        if not _whole(spec[key]):
            return f"has {key}={spec[key]!r}; expected a whole number in [1, {MAX_FEATURES}]"
    for key in ("in_modes", "out_modes", "bonds"):
        if not _modes(spec[key]):
            return (f"has {key}={spec[key]!r}; expected 1 to {MAX_MODES} whole numbers in "
                    f"[1, {MAX_FEATURES}]")
    if spec["padding_idx"] is not None and not _whole(spec["padding_idx"], -MAX_FEATURES):
        return f"has padding_idx={spec['padding_idx']!r}; expected null or a whole number"
    if spec["merge_pairs"] is not None and not isinstance(spec["merge_pairs"], bool):
        return f"has merge_pairs={spec['merge_pairs']!r}; expected null, true or false"
    return _tau_bias_problem(spec)


def _embedding_build(spec: Mapping[str, Any], factory: dict) -> GatedLayer:
    return TTEmbedding(spec["in_features"], spec["out_features"], spec["in_modes"],
                       spec["out_modes"], list(spec["bonds"]), spec["padding_idx"],
                       float(spec["tau"]), merge_pairs=bool(spec["merge_pairs"]), **factory)


def _table_fits(module: nn.Module, rows: int, dim: int, padding_idx: int | None) -> str | None:
    """Why the ``nn.Embedding`` ``module`` cannot be replaced by a recorded table of ``rows`` x
    ``dim`` with ``padding_idx`` (None when it can)."""
    if module.padding_idx != padding_idx:
        return f"padding_idx={module.padding_idx} in the model, {padding_idx} in the checkpoint"
    mine, theirs = (module.num_embeddings, module.embedding_dim), (rows, dim)
    if mine != theirs:
        return f"(rows, dim) are {mine} in the model, {theirs} in the checkpoint"
    return None


def _embedding_fits(module: nn.Module, spec: Mapping[str, Any]) -> str | None:
    return _table_fits(module, spec["in_features"], spec["out_features"], spec["padding_idx"])


# -- tables in any format that holds one (GatedEmbedding) --------------------------------------
TABLE_KEYS = ("format", "layout", "num_embeddings", "padding_idx", "tau")


def _table_write(layer: GatedEmbedding) -> dict[str, Any]:
    return {"kind": "GatedEmbedding", "format": layer.format.name,
            "layout": layer.layout.to_dict(), "num_embeddings": int(layer.num_embeddings),
            "padding_idx": layer.padding_idx, "tau": float(layer.tau)}


def _table_problem(spec: Mapping[str, Any]) -> str | None:
    """What is wrong with a GatedEmbedding record: the keys, a format that holds tables, a
    layout that format builds for a table at those bond sizes (a format without modes: rows
    and dim as its single modes), rows the layout covers, a padding row among them, tau."""
    layout, why = _format_layout(spec, TABLE_KEYS, table_formats(),
                                 "the formats that hold tables are")
    if why is not None:
        return why
    rows = spec["num_embeddings"]
    if not _whole(rows) or rows > layout.in_features:
        return (f"has num_embeddings={rows!r}; expected a whole number in [1, "
                f"{layout.in_features}] (the rows its layout covers)")
    if not get_format(spec["format"]).uses_modes and (
            layout.in_modes != (rows,) or len(layout.out_modes) != 1):
        return (f"has a layout of modes {layout.in_modes} x {layout.out_modes}; the "
                f"{spec['format']} format holds a table of {rows} rows as one mode each side")
    padding = spec["padding_idx"]
    if padding is not None and not _whole(padding, 0, rows - 1):
        return f"has padding_idx={padding!r}; expected null or a whole number in [0, {rows})"
    return _tau_problem(spec)


def _table_build(spec: Mapping[str, Any], factory: dict) -> GatedLayer:
    layout = Layout.from_dict(spec["layout"])
    modes = ((layout.in_modes, layout.out_modes) if get_format(spec["format"]).uses_modes
             else (None, None))
    return GatedEmbedding(spec["num_embeddings"], layout.out_features, *modes,
                          list(layout.bond_sizes), spec["padding_idx"], float(spec["tau"]),
                          format=spec["format"], **factory)


def _table_record_fits(module: nn.Module, spec: Mapping[str, Any]) -> str | None:
    dim = Layout.from_dict(spec["layout"]).out_features
    return _table_fits(module, spec["num_embeddings"], dim, spec["padding_idx"])


# -- CoLA's B act(A x) (ColaLinear: no format, its layout fixed by its sizes) --------------------
COLA_KEYS = ("in_features", "out_features", "rank", "activation", "bias", "tau")


def _cola_write(layer: ColaLinear) -> dict[str, Any]:
    return {"kind": "ColaLinear", "in_features": int(layer.in_features),
            "out_features": int(layer.out_features), "rank": int(layer.rank),
            "activation": layer.activation, "bias": layer.bias is not None,
            "tau": float(layer.tau)}


def _cola_problem(spec: Mapping[str, Any]) -> str | None:
    missing = [k for k in COLA_KEYS if k not in spec]
    if missing:
        return f"lacks {', '.join(missing)}"
    for key in ("in_features", "out_features", "rank"):
        if not _whole(spec[key]):
            return f"has {key}={spec[key]!r}; expected a whole number in [1, {MAX_FEATURES}]"
    if spec["activation"] not in ACTIVATIONS:
        return (f"has activation={spec['activation']!r}; expected one of "
                f"{', '.join(ACTIVATIONS)}")
    return _tau_bias_problem(spec)


def _cola_build(spec: Mapping[str, Any], factory: dict) -> GatedLayer:
    return ColaLinear(spec["in_features"], spec["out_features"], spec["rank"],
                      spec["activation"], spec["bias"], float(spec["tau"]), **factory)


def _cola_fits(module: nn.Module, spec: Mapping[str, Any]) -> str | None:
    return ("the checkpoint holds a CoLA layer (B act(A x)), which no conversion of an "
            f"nn.{type(module).__name__} makes, and the model lacks it: build the model with "
            "linear='cola' first, then load")


KINDS: dict[str, RecordKind] = {
    "TTEmbedding": RecordKind("TTEmbedding", lambda m: isinstance(m, TTEmbedding),
                              _embedding_write, _legacy_problem, _embedding_build, nn.Embedding,
                              _embedding_fits, "embedding"),
    "GatedEmbedding": RecordKind("GatedEmbedding",
                                 lambda m: isinstance(m, GatedEmbedding)
                                 and not isinstance(m, TTEmbedding),
                                 _table_write, _table_problem, _table_build, nn.Embedding,
                                 _table_record_fits, "embedding"),
    "GatedLinear": RecordKind("GatedLinear", lambda m: isinstance(m, GatedLinear),
                              _linear_write, _linear_problem, _linear_build, nn.Linear,
                              _linear_fits, "linear"),
    "ColaLinear": RecordKind("ColaLinear", lambda m: isinstance(m, ColaLinear), _cola_write,
                             _cola_problem, _cola_build, nn.Linear, _cola_fits, "linear"),
}


def kind_of(layer: GatedLayer) -> RecordKind:
    """The record kind that describes ``layer``."""
    for kind in KINDS.values():
        if kind.owns(layer):
            return kind
    raise CheckpointError(f"layer type {type(layer).__name__} is a GatedLayer that records "
                          f"do not know; expected one of {', '.join(KINDS)}.")


# -- writing, upgrading, checking, building -------------------------------------------------------
def layer_spec(layer: GatedLayer) -> dict[str, Any]:
    """The record of ``layer`` at its current (stored) sizes: what it takes to rebuild it."""
    return kind_of(layer).write(layer)


def upgrade(spec: Mapping[str, Any]) -> Mapping[str, Any]:
    """A record of a kind written before the format protocol (TTLinear / TTMLinear: modes and
    chain bonds) as the GatedLinear record it stands for; other records as they are. The
    record's values must have passed :func:`record_problem`."""
    if not isinstance(spec, Mapping) or spec.get("kind") not in LEGACY:
        return spec
    fmt = LEGACY[spec["kind"]]
    layout = get_format(fmt).layout(tuple(spec["in_modes"]), tuple(spec["out_modes"]),
                                    list(spec["bonds"]))
    return {"kind": "GatedLinear", "format": fmt, "layout": layout.to_dict(),
            "bias": spec["bias"], "tau": spec["tau"]}


def record_problem(spec: Any) -> str | None:
    """What is wrong with a record's values (None when nothing is): old records included."""
    if not isinstance(spec, Mapping):
        return f"is a {type(spec).__name__}, not a mapping"
    kind = spec.get("kind")
    if kind in LEGACY:
        why = _legacy_problem(spec)
        if why is not None:
            return why
        for side in ("in", "out"):
            if math.prod(spec[f"{side}_modes"]) != spec[f"{side}_features"]:
                return (f"has {side}_modes={list(spec[f'{side}_modes'])} for "
                        f"{side}_features={spec[f'{side}_features']}; they must multiply to it")
        try:
            spec = upgrade(spec)
        except ConfigError as exc:
            return f"describes no valid layer ({exc})"
    if kind not in KINDS and kind not in LEGACY:
        return f"has kind {kind!r}; expected one of {', '.join([*KINDS, *LEGACY])}"
    return KINDS[spec["kind"]].problem(spec)


def build_layer(spec: Mapping[str, Any], like: Tensor) -> GatedLayer:
    """The gated layer a record describes (old records included), with the recorded sizes and
    tau, on ``like``'s dtype and device (weights uninitialised: load them next)."""
    spec = upgrade(spec)
    layer = KINDS[spec["kind"]].build(spec, {"dtype": like.dtype, "device": like.device})
    layer.tau = float(spec["tau"])
    return layer


def read_records(layers: Any, state: Mapping[str, Any], where: str) -> dict[str, dict]:
    """The layer records read from a file, checked and upgraded to today's kinds. Refused, with
    a :class:`CheckpointError` naming the layer and what is wrong, before anything is built or
    allocated: records whose values are wrong, or whose layer (built on the meta device, no
    memory) has a tensor that ``state`` lacks or holds in another shape."""
    if not isinstance(layers, Mapping) or not all(isinstance(n, str) for n in layers):
        raise CheckpointError(f"{where}: the layer records are not a mapping of names to "
                              "records; the file is damaged or was edited.")
    read = {}
    for name, spec in layers.items():
        def refuse(why: str, name: str = name) -> CheckpointError:
            return CheckpointError(f"{where}: the record of layer {name or '<model>'} {why}; "
                                   "the file is damaged or was edited.")

        why = record_problem(spec)
        if why is not None:
            raise refuse(why)
        spec = dict(upgrade(spec))
        try:
            meta = build_layer(spec, torch.empty(0, device="meta"))
        except (ValueError, TypeError, RuntimeError, OverflowError, IndexError) as exc:
            raise refuse(f"describes no valid layer ({type(exc).__name__}: {exc})") from None
        for key, expected in meta.state_dict().items():
            full = f"{name}.{key}" if name else key
            got = state.get(full)
            if key == "core_scales" and got is None:
                continue  # cores saved with the plain parametrization (or before it existed)
            if not isinstance(got, Tensor):
                raise refuse(f"needs the tensor {full}, which the file lacks")
            if key == "core_scales" and not bool(
                    (torch.isfinite(got) & (got > 0)).all()) if got.numel() else False:
                raise refuse(f"holds core scales {got.tolist()}; each is a finite number > 0")
            if tuple(got.shape) != tuple(expected.shape):
                raise refuse(f"gives {full} the shape {tuple(expected.shape)}, but the file "
                             f"holds {tuple(got.shape)}")
        read[name] = spec
    return read


__all__ = ["KINDS", "LEGACY", "TABLE_KEYS", "RecordKind", "build_layer", "builds_from_modes",
           "kind_of", "layer_spec", "layout_problem", "read_records", "record_problem", "upgrade"]
