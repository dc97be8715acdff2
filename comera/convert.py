"""Convert an existing torch model in place: matching nn.Linear / nn.Embedding -> TT layers.

As in PEFT: validate the config, match modules by qualified name and type, replace each match
with a TT layer initialised by TT-SVD of its trained weight, and return a report. When nothing
matches, the error lists the modules that were searched.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn

from comera.embedding import TTEmbedding
from comera.errors import ConfigError, ConversionError
from comera.layers import DEFAULT_TAU, TTLinear, TTMLinear
from comera.surgery import swap_submodule

FORMATS = ("tt", "ttm")


@dataclass(frozen=True)
class ConvertConfig:
    """What to convert and how.

    include / exclude: fnmatch patterns over qualified module names ("*" matches all).
    ranks: a max rank for every layer, or {pattern: max rank}, first match wins.
    target_compression: instead of ranks, the largest uniform max rank per layer whose TT size
    is at most dense / target (per layer).
    """

    include: Sequence[str] = ("*",)
    exclude: Sequence[str] = ()
    linear: bool = True
    embedding: bool = False
    ranks: int | Mapping[str, int] = 16
    target_compression: float | None = None
    d: int = 3
    tau: float = DEFAULT_TAU
    format: str = "tt"
    modes: Mapping[str, tuple[Sequence[int], Sequence[int]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError(f"format={self.format!r}; choose one of {', '.join(FORMATS)}.")
        if self.target_compression is not None and not self.target_compression > 1:
            raise ConfigError(f"target_compression={self.target_compression}; it must be > 1 "
                              "(dense size / TT size).")
        if isinstance(self.ranks, int) and self.ranks < 1:
            raise ConfigError(f"ranks={self.ranks}; a rank is at least 1.")
        if self.d < 1:
            raise ConfigError(f"d={self.d}; a TT layer has at least one mode per side.")
        if not (self.linear or self.embedding):
            raise ConfigError("linear and embedding are both False: nothing would be converted.")

    def rank_for(self, name: str) -> int:
        """The max rank for the layer named ``name``: ``ranks`` itself, or the value of the first
        pattern in ``ranks`` that matches (a :class:`ConfigError` when none does)."""
        if isinstance(self.ranks, int):
            return self.ranks
        for pattern, rank in self.ranks.items():
            if fnmatch.fnmatchcase(name, pattern):
                return rank
        raise ConfigError(f"no ranks pattern matches layer {name!r}; add one or use '*'.")


@dataclass(frozen=True)
class LayerReport:
    """One converted layer: name, type, dense shape, modes, ranks and parameters before/after."""

    name: str
    kind: str
    shape: tuple[int, int]
    modes: tuple[tuple[int, ...], tuple[int, ...]]
    ranks: tuple[int, ...]
    before: int
    after: int


@dataclass(frozen=True)
class ConversionReport:
    """Per converted layer: shapes, modes, ranks and parameters before/after."""

    layers: tuple[LayerReport, ...]

    @property
    def before(self) -> int:
        """Parameters of the converted layers before conversion (dense)."""
        return sum(r.before for r in self.layers)

    @property
    def after(self) -> int:
        """Parameters of the converted layers after conversion (TT)."""
        return sum(r.after for r in self.layers)

    def __str__(self) -> str:
        head = ("layer", "type", "shape", "modes", "ranks", "params", "TT params", "ratio")
        rows = [head]
        for r in self.layers:
            modes = f"{list(r.modes[0])}x{list(r.modes[1])}"
            rows.append((r.name, r.kind, f"{r.shape[0]}x{r.shape[1]}", modes,
                         str(list(r.ranks)), f"{r.before:,}", f"{r.after:,}",
                         f"{r.before / max(r.after, 1):.1f}x"))
        rows.append(("total", "", "", "", "", f"{self.before:,}", f"{self.after:,}",
                     f"{self.before / max(self.after, 1):.1f}x"))
        widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True))
                 for row in rows]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join(lines)


def _matches(name: str, config: ConvertConfig) -> bool:
    return (any(fnmatch.fnmatchcase(name, p) for p in config.include)
            and not any(fnmatch.fnmatchcase(name, p) for p in config.exclude))


def _rank_for_target(make, dense: int, target: float) -> int:
    """The largest max rank whose TT cores hold at most dense/target parameters (at least 1).

    The size grows with the max rank until every bond reaches its TT-SVD bound, so bisect.
    """
    def size(rank: int) -> int:
        layer = make(rank)
        return sum(c.numel() for c in layer.cores)

    lo, hi = 1, 1
    while size(hi) <= dense / target and hi < 1 << 16:
        if size(hi * 2) == size(hi):  # every bond is at its bound already
            return hi
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= dense / target else (lo, mid)
    return lo


def _convert_one(name: str, module: nn.Module, config: ConvertConfig):
    modes = config.modes.get(name, (None, None))
    if isinstance(module, nn.Linear):
        cls = TTLinear if config.format == "tt" else TTMLinear

        def make(rank):
            return cls(module.in_features, module.out_features, modes[0], modes[1], rank,
                       module.bias is not None, config.tau, config.d)

        dense = module.in_features * module.out_features
        rank = (_rank_for_target(make, dense, config.target_compression)
                if config.target_compression else config.rank_for(name))
        return cls.from_linear(module, rank, modes[0], modes[1], config.tau, config.d)

    def make_emb(rank):
        return TTEmbedding(module.num_embeddings, module.embedding_dim, modes[0], modes[1], rank,
                           module.padding_idx, config.tau, config.d)

    dense = module.num_embeddings * module.embedding_dim
    rank = (_rank_for_target(make_emb, dense, config.target_compression)
            if config.target_compression else config.rank_for(name))
    return TTEmbedding.from_embedding(module, rank, modes[0], modes[1], config.tau, config.d)


def convert_(
    model: nn.Module, config: ConvertConfig | None = None, **overrides
) -> ConversionReport:
    """Replace the matching Linear/Embedding modules of ``model`` by TT layers, in place."""
    if config is None:
        config = ConvertConfig(**overrides)
    elif overrides:
        raise ConfigError("pass either a ConvertConfig or keyword options, not both.")
    types: tuple[type, ...] = ()
    if config.linear:
        types += (nn.Linear,)
    if config.embedding:
        types += (nn.Embedding,)
    candidates = [(n, m) for n, m in model.named_modules() if isinstance(m, types) and n]
    chosen = [(n, m) for n, m in candidates if _matches(n, config)]
    if not chosen:
        searched = ", ".join(n for n, _ in candidates) or "none"
        kinds = "/".join(t.__name__ for t in types)
        raise ConversionError(
            f"no {kinds} module matches include={list(config.include)} "
            f"exclude={list(config.exclude)}; modules of that type searched: {searched}."
        )
    reports = []
    for name, module in chosen:
        layer = _convert_one(name, module, config)
        swap_submodule(model, name, layer)
        shape = ((module.in_features, module.out_features) if isinstance(module, nn.Linear)
                 else (module.num_embeddings, module.embedding_dim))
        before = sum(p.numel() for p in module.parameters())
        reports.append(LayerReport(name, type(layer).__name__, shape,
                                   (layer.in_modes, layer.out_modes), layer.ranks, before,
                                   layer.num_parameters(effective=True)))
    return ConversionReport(tuple(reports))


