"""DLRM (Naumov et al. 2019) with its large embedding tables in a format that holds tables
(``table_format``, e.g. TT-matrix tables), or dense (``table_format="dense"``, the default).

One example is 13 dense features and one categorical id per table. The model:

1. a bottom MLP maps the dense features to a vector of ``embedding_dim`` (ReLU after every
   layer, as in the reference implementation);
2. each categorical id is looked up in its table: a plain ``nn.Embedding``, or a
   :class:`~comera.layers.embedding.TTEmbedding` (a table in ``table_format``) for tables of at
   least ``tt_min_rows`` rows when ``table_format`` is not ``"dense"`` (a TT table of a few
   hundred rows saves nothing and costs a contraction);
3. the interaction takes the dot product of every pair of the ``1 + T`` vectors (the strict
   upper triangle of their Gram matrix) and concatenates them to the bottom MLP's output;
4. a top MLP maps that to one logit (ReLU between layers, none after the last).

The defaults are the reference Criteo-Kaggle model: 26 tables of 33,762,577 rows in all,
dimension 16 (540M floats, 2.16 GB), bottom MLP 13-512-256-64-16, top MLP 367-512-256-1.
``max_rows`` caps every table (dense and TT alike) so the same model fits a laptop; the data
must then use the capped sizes (:attr:`DLRMConfig.table_sizes`), e.g. by hashing ids into them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import InitVar, dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from comera.data.criteo import CRITEO_KAGGLE_CARDINALITIES, CRITEO_NUM_DENSE
from comera.errors import ConfigError, LookupIndexError
from comera.formats.registry import DENSE
from comera.formats.tt_flag import NO_FLAG, format_from_tt, restore_kind_
from comera.layers.cached_embedding import CachedTTEmbedding
from comera.layers.embedding import embedding_class, gated_embedding, table_format
from comera.layers.linear import DEFAULT_TAU, GatedLayer
from comera.numbers import is_int

log = logging.getLogger("comera.models")


def _positive_ints(name: str, values, minimum: int = 1) -> tuple[int, ...]:
    try:
        out = tuple(values)
    except TypeError:
        raise ConfigError(f"{name}={values!r}; give a sequence of ints.") from None
    for v in out:
        if not is_int(v, minimum):
            raise ConfigError(f"{name}={out} holds {v!r}; every entry is an int >= {minimum}.")
    return out


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if not is_int(value, minimum):
        raise ConfigError(f"{name}={value!r}; it must be an int >= {minimum}.")
    return value


class _Default(str):
    """A field's default as the class wrote it: a value the caller did not give."""


# the tables the deprecated tt=True meant when no table_format was given
_TT_TABLES = "ttm"


@dataclass(frozen=True)
class DLRMConfig:
    """Sizes of a DLRM and the kind of its large tables; ``table_format="dense"`` (the default)
    is the dense baseline of the same model. ``tt`` (deprecated until 0.3.0, with a
    DeprecationWarning): ``tt=False`` reads as ``table_format="dense"``, ``tt=True`` as the
    given ``table_format`` (``"ttm"`` when none is given).

    ``bottom_mlp`` and ``top_mlp`` list the output width of every layer: the bottom one ends at
    ``embedding_dim`` (its output joins the interaction), the top one at 1 (the logit).
    """

    num_dense: int = CRITEO_NUM_DENSE
    cardinalities: tuple[int, ...] = CRITEO_KAGGLE_CARDINALITIES
    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (512, 256, 64, 16)
    top_mlp: tuple[int, ...] = (512, 256, 1)
    max_rows: int | None = None  # cap on every table's rows (dense and TT alike), for small runs
    # the large tables' kind: "dense", or a format that holds tables (table_formats(); a format
    # word is read as the table it takes: "tt" holds TT-matrix tables, "ttm")
    table_format: str = _Default(DENSE)
    tt_ranks: int = 32
    tt_min_rows: int = 10_000  # smaller tables stay nn.Embedding in a compressed model
    tt_d: int = 3  # number of TT-matrix cores per table
    tau: float = DEFAULT_TAU
    # TT-Rec hot-row cache: dense rows for this many most frequent ids of each TT table
    # (comera.layers.cached_embedding); choose them from the training data with choose_hot_rows_
    tt_cache_rows: int = 0
    tt: InitVar[Any] = NO_FLAG  # deprecated: see the class docstring

    def __post_init__(self, tt: Any) -> None:
        kind = self.table_format
        if tt is not NO_FLAG and tt is not None:
            given = _TT_TABLES if tt is True and isinstance(kind, _Default) else kind
            kind = format_from_tt(tt, given, "DLRMConfig(table_format={})", stacklevel=4)
        if not isinstance(kind, str):
            raise ConfigError(f"table_format={kind!r}; give 'dense' or a format that holds "
                              "tables, e.g. 'ttm'.")
        object.__setattr__(self, "table_format", DENSE if kind == DENSE
                           else table_format(kind, "table_format"))
        _positive_int("num_dense", self.num_dense)
        cards = _positive_ints("cardinalities", self.cardinalities)
        if not cards:
            raise ConfigError("cardinalities is empty; a DLRM needs at least one table.")
        object.__setattr__(self, "cardinalities", cards)
        _positive_int("embedding_dim", self.embedding_dim)
        bottom = _positive_ints("bottom_mlp", self.bottom_mlp)
        top = _positive_ints("top_mlp", self.top_mlp)
        if not bottom or bottom[-1] != self.embedding_dim:
            raise ConfigError(
                f"bottom_mlp={bottom} must end at embedding_dim={self.embedding_dim}: its output "
                f"joins the embeddings in the interaction (e.g. (512, 256, 64, "
                f"{self.embedding_dim}))."
            )
        if not top or top[-1] != 1:
            raise ConfigError(f"top_mlp={top} must end at 1 (the logit), e.g. (512, 256, 1).")
        object.__setattr__(self, "bottom_mlp", bottom)
        object.__setattr__(self, "top_mlp", top)
        if self.max_rows is not None:
            _positive_int("max_rows", self.max_rows)
        _positive_int("tt_ranks", self.tt_ranks)
        _positive_int("tt_min_rows", self.tt_min_rows)
        _positive_int("tt_d", self.tt_d)
        _positive_int("tt_cache_rows", self.tt_cache_rows, minimum=0)
        if not isinstance(self.tau, int | float) or math.isnan(self.tau) or self.tau < 0:
            raise ConfigError(f"tau={self.tau!r}; the gate threshold is a number >= 0.")

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A config pickled with the ``tt`` flag of before loads as the kind it built (TT-matrix
        tables where it stored no kind: pickled before ``table_format``)."""
        restore_kind_(self, state, "table_format", _TT_TABLES)

    @property
    def table_sizes(self) -> tuple[int, ...]:
        """Rows of each table after the ``max_rows`` cap: ids must lie in ``[0, size)``."""
        cap = self.max_rows
        return tuple(c if cap is None else min(c, cap) for c in self.cardinalities)

    @property
    def num_tables(self) -> int:
        return len(self.cardinalities)

    @property
    def num_interactions(self) -> int:
        """Pairs among the bottom output and the T embeddings: F (F - 1) / 2 with F = 1 + T."""
        f = 1 + self.num_tables
        return f * (f - 1) // 2

    def is_tt_table(self, k: int) -> bool:
        """Whether table ``k`` is a gated table (in ``table_format``) in this configuration."""
        return self.table_format != DENSE and self.table_sizes[k] >= self.tt_min_rows


def _mlp(n_in: int, widths: tuple[int, ...], relu_last: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for k, width in enumerate(widths):
        linear = nn.Linear(n_in, width)
        # the reference DLRM initialisation: Glorot-normal weights, N(0, 1/width) biases
        with torch.no_grad():
            linear.weight.normal_(0.0, math.sqrt(2.0 / (n_in + width)))
            linear.bias.normal_(0.0, math.sqrt(1.0 / width))
        layers.append(linear)
        if relu_last or k < len(widths) - 1:
            layers.append(nn.ReLU())
        n_in = width
    return nn.Sequential(*layers)


def _dense_table(rows: int, dim: int) -> nn.Embedding:
    table = nn.Embedding(rows, dim)
    with torch.no_grad():  # the reference DLRM initialisation: U(-1/sqrt(rows), 1/sqrt(rows))
        table.weight.uniform_(-math.sqrt(1.0 / rows), math.sqrt(1.0 / rows))
    return table


class DLRM(nn.Module):
    """Bottom MLP, embedding tables (TT or dense), pairwise dot interaction, top MLP -> logit."""

    def __init__(self, cfg: DLRMConfig | None = None):
        super().__init__()
        cfg = cfg or DLRMConfig()
        self.cfg = cfg
        self.bottom = _mlp(cfg.num_dense, cfg.bottom_mlp, relu_last=True)
        tables: list[nn.Module] = []
        for k, rows in enumerate(cfg.table_sizes):
            if cfg.is_tt_table(k):
                table = gated_embedding(rows, cfg.embedding_dim, cfg.table_format,
                                        ranks=cfg.tt_ranks, tau=cfg.tau, d=cfg.tt_d)
                if cfg.tt_cache_rows:
                    table = CachedTTEmbedding(table, min(cfg.tt_cache_rows, rows))
                tables.append(table)
            else:
                tables.append(_dense_table(rows, cfg.embedding_dim))
        self.embeddings = nn.ModuleList(tables)
        self.top = _mlp(cfg.embedding_dim + cfg.num_interactions, cfg.top_mlp, relu_last=False)
        f = 1 + cfg.num_tables
        rows_idx, cols_idx = torch.triu_indices(f, f, offset=1)  # (P,), (P,): i < j pairs
        self.register_buffer("_pair_rows", rows_idx, persistent=False)
        self.register_buffer("_pair_cols", cols_idx, persistent=False)
        self.register_buffer("_table_sizes", torch.tensor(cfg.table_sizes), persistent=False)

    # -- compute --------------------------------------------------------------------------------
    def _check_inputs(self, dense: Tensor, sparse: Tensor) -> None:
        cfg = self.cfg
        if not isinstance(dense, Tensor) or dense.dim() != 2 or dense.shape[1] != cfg.num_dense \
                or not dense.is_floating_point():
            raise ConfigError(f"dense features must be a (batch, {cfg.num_dense}) float tensor, "
                              f"got {_describe(dense)}.")
        if not isinstance(sparse, Tensor) or sparse.dim() != 2 \
                or sparse.shape[1] != cfg.num_tables or sparse.dtype not in (torch.int64,
                                                                             torch.int32):
            raise ConfigError(f"sparse ids must be a (batch, {cfg.num_tables}) int64/int32 "
                              f"tensor (one id per table), got {_describe(sparse)}.")
        if dense.shape[0] != sparse.shape[0]:
            raise ConfigError(f"dense features have {dense.shape[0]} rows but sparse ids "
                              f"{sparse.shape[0]}; they describe the same examples.")
        bad = (sparse < 0) | (sparse >= self._table_sizes)  # (B, T)
        if bool(bad.any()):
            row, table = (int(v) for v in bad.nonzero()[0])
            size = cfg.table_sizes[table]
            hint = (f" (table capped by max_rows={cfg.max_rows} from {cfg.cardinalities[table]};"
                    " generate or hash the data into DLRMConfig.table_sizes)"
                    if size < cfg.cardinalities[table] else "")
            raise LookupIndexError(f"id {int(sparse[row, table])} of example {row} is out of "
                                   f"range for table {table} of {size} rows{hint}; ids must lie "
                                   f"in [0, {size}).")

    def interact(self, x: Tensor, embedded: list[Tensor]) -> Tensor:
        """The bottom output and the dot product of every pair of the 1 + T vectors."""
        feats = torch.stack([x, *embedded], dim=1)  # (B, F, D)
        gram = torch.bmm(feats, feats.transpose(1, 2))  # (B, F, F)
        pairs = gram[:, self._pair_rows, self._pair_cols]  # (B, P): strict upper triangle
        return torch.cat([x, pairs], dim=1)  # (B, D + P)

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        """Logits (B,) of ``dense`` (B, num_dense) features and ``sparse`` (B, T) ids."""
        self._check_inputs(dense, sparse)
        x = self.bottom(dense)  # (B, D)
        embedded = [table(sparse[:, k]) for k, table in enumerate(self.embeddings)]  # T x (B, D)
        z = self.interact(x, embedded)  # (B, D + P)
        return self.top(z).squeeze(1)  # (B,)

    # -- sizes ----------------------------------------------------------------------------------
    def table_parameters(self, effective: bool = True) -> int:
        """Parameters of all embedding tables; TT tables at their effective ranks (with their
        hot-row caches)."""
        return sum(t.num_parameters(effective) if isinstance(t, GatedLayer | CachedTTEmbedding)
                   else t.weight.numel() for t in self.embeddings)

    def choose_hot_rows_(self, sparse: Tensor) -> list[int]:
        """Cache, in each cached TT table, its ``tt_cache_rows`` most frequent ids in ``sparse``
        (the training ids, (N, T)). Returns, per cached table, the share of ``sparse``'s
        lookups the cache answers (in percent, rounded)."""
        shares = []
        for k, table in enumerate(self.embeddings):
            if isinstance(table, CachedTTEmbedding):
                ids = sparse[:, k].long()
                table.choose_hot_ids_(torch.bincount(ids, minlength=table.num_embeddings))
                shares.append(round(100 * table.hit_rate(ids)))
        return shares

    def dense_table_parameters(self) -> int:
        """Parameters the same tables take as dense ``nn.Embedding`` weights."""
        return sum(self.cfg.table_sizes) * self.cfg.embedding_dim

    # -- conversion -----------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, model: DLRM, tt_ranks: int | None = None,
                   format: str = _TT_TABLES) -> DLRM:
        """A DLRM whose large tables are decompositions of ``model``'s in ``format`` (by
        default TT-matrix tables, TT-SVDs: exact at full rank).

        The MLPs and the small tables are copied; ``tt_ranks`` (default ``model.cfg.tt_ranks``)
        caps the ranks of the converted tables.
        """
        if not isinstance(model, DLRM):
            raise ConfigError(f"from_dense takes a DLRM, got {type(model).__name__}.")
        if any(isinstance(t, GatedLayer) for t in model.embeddings):
            raise ConfigError("from_dense takes a dense DLRM (table_format='dense'); this one "
                              "already has compressed tables.")
        if format == DENSE:
            raise ConfigError("from_dense(format='dense'): give the format of the converted "
                              "tables, e.g. 'ttm'.")
        cfg = replace(model.cfg, table_format=format,
                      tt_ranks=tt_ranks or model.cfg.tt_ranks)
        like = next(model.parameters())
        out = cls(cfg).to(device=like.device, dtype=like.dtype)
        out.bottom.load_state_dict(model.bottom.state_dict())
        out.top.load_state_dict(model.top.state_dict())
        for k, table in enumerate(model.embeddings):
            if cfg.is_tt_table(k):
                out.embeddings[k] = embedding_class(cfg.table_format).from_embedding(
                    table, ranks=cfg.tt_ranks, tau=cfg.tau, d=cfg.tt_d, format=cfg.table_format)
            else:
                out.embeddings[k].load_state_dict(table.state_dict())
        log.debug("converted %d DLRM tables to TT at ranks <= %d",
                  sum(cfg.is_tt_table(k) for k in range(cfg.num_tables)), cfg.tt_ranks)
        return out


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
