"""TT-Rec's hot-row cache (Yin et al., MLSys 2021): frequent ids keep dense rows.

Click data is heavy-tailed: on a Zipf table the top 1,000 ids carry about half of the lookups,
and a low-rank TT table represents those few ids worst relative to how often they are asked for.
:class:`CachedTTEmbedding` wraps a :class:`~comera.layers.embedding.TTEmbedding` (or a table of
any format, :class:`~comera.layers.embedding.GatedEmbedding`): the ``cache_rows``
most frequent ids (chosen from counts over the training data, :meth:`choose_hot_ids_`) are
looked up in a dense ``cache`` parameter of shape ``(cache_rows, embedding_dim)``; every other
id is reconstructed from the TT cores. The cache starts from the TT rows it replaces, so wrapping
does not change the function; afterwards each part gets the gradients of its own ids.

Sizes (:mod:`comera.ranks.size`): the cache counts with its TT table, at ``cache_rows *
embedding_dim`` parameters, in the model size and in the table's compression; the dense size is
the plain table's (the cached rows are rows of it, not extra ones).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from comera.errors import ConfigError, LookupIndexError
from comera.layers.embedding import GatedEmbedding, check_ids


class CachedTTEmbedding(nn.Module):
    """A TT table with dense rows for its ``cache_rows`` hot ids (see the module docstring)."""

    def __init__(self, tt: GatedEmbedding, cache_rows: int):
        super().__init__()
        if not isinstance(tt, GatedEmbedding):
            raise ConfigError(f"CachedTTEmbedding wraps a TTEmbedding (or any GatedEmbedding), "
                              f"got {type(tt).__name__}.")
        if isinstance(cache_rows, bool) or not isinstance(cache_rows, int) \
                or not 0 <= cache_rows <= tt.num_embeddings:
            raise ConfigError(f"cache_rows={cache_rows!r}; an int in [0, {tt.num_embeddings}] "
                              "(the table's rows).")
        self.tt = tt
        self.num_embeddings, self.embedding_dim = tt.num_embeddings, tt.embedding_dim
        like = tt.cores[0]
        self.cache = nn.Parameter(like.new_zeros(cache_rows, tt.embedding_dim))  # (C, D)
        # (C,) ascending: an id's cache row is its position here (found by binary search, so
        # the cache costs O(C) memory, not a map over all V rows)
        self.register_buffer("hot_ids", torch.arange(cache_rows, device=like.device))
        self.choose_hot_ids_(torch.arange(cache_rows, 0, -1, device=like.device).float()
                             if cache_rows else torch.zeros(0))

    @property
    def cache_rows(self) -> int:
        """How many hot ids have dense rows (the cache's first dimension)."""
        return self.cache.shape[0]

    def choose_hot_ids_(self, counts: Tensor) -> Tensor:
        """Cache the ``cache_rows`` ids with the largest ``counts`` (a (V,) tensor, or a shorter
        one: missing ids count 0; ties go to the smaller id). The cache rows are set to the TT
        rows of those ids. Returns the chosen ids, ascending."""
        counts = counts.detach().reshape(-1).to(torch.float64).cpu()
        if counts.numel() > self.num_embeddings:
            raise ConfigError(f"counts has {counts.numel()} entries for a table of "
                              f"{self.num_embeddings} rows.")
        full = torch.zeros(self.num_embeddings, dtype=torch.float64)
        full[: counts.numel()] = counts
        # stable order: largest count first, smaller id first among equal counts
        order = torch.sort(-full, stable=True).indices[: self.cache_rows]
        hot = order.sort().values.to(self.hot_ids.device)
        with torch.no_grad():
            self.hot_ids.copy_(hot)
            if hot.numel():
                self.cache.copy_(self.tt(hot).to(self.cache.dtype))
        return hot

    def forward(self, ids: Tensor) -> Tensor:
        """Rows at ``ids`` (any shape) -> ``(*ids.shape, embedding_dim)``: cached ids from the
        cache, the rest from the TT cores."""
        check_ids(ids, "CachedTTEmbedding")
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise LookupIndexError(f"ids must lie in [0, {self.num_embeddings}); got "
                                   f"[{int(flat.min())}, {int(flat.max())}].")
        slot = self.slots(flat)  # (N,)
        hit = slot >= 0  # (N,)
        rows = self.cache.new_zeros(flat.numel(), self.embedding_dim)  # (N, D)
        if bool(hit.any()):
            rows = rows.index_put((hit.nonzero().flatten(),), self.cache[slot[hit]])
        miss = ~hit
        if bool(miss.any()):
            rows = rows.index_put((miss.nonzero().flatten(),),
                                  self.tt(flat[miss]).to(rows.dtype))
        return rows.reshape(*ids.shape, self.embedding_dim)

    def slots(self, ids: Tensor) -> Tensor:
        """The cache row of each of ``ids`` (flat, in range), -1 where the id is not cached."""
        ids = ids.to(self.hot_ids.dtype).contiguous()
        if not self.cache_rows:
            return torch.full_like(ids, -1)
        pos = torch.searchsorted(self.hot_ids, ids).clamp_(max=self.cache_rows - 1)  # (N,)
        return torch.where(self.hot_ids[pos] == ids, pos, torch.full_like(pos, -1))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # checkpoints written before the binary search carry a (V,) id -> row map: not needed
        state_dict.pop(prefix + "slot", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def num_parameters(self, effective: bool = True) -> int:
        """The TT table's parameters (at its effective ranks, by default) plus the cache's."""
        return self.tt.num_parameters(effective) + self.cache.numel()

    def dense_num_parameters(self) -> int:
        """The plain dense table's parameters (the cached rows are rows of it)."""
        return self.tt.dense_num_parameters()

    def hit_rate(self, ids: Tensor) -> float:
        """The fraction of ``ids`` the cache answers."""
        return float((self.slots(ids.reshape(-1)) >= 0).float().mean()) if ids.numel() else 0.0

    def extra_repr(self) -> str:
        return f"cache_rows={self.cache_rows}"
