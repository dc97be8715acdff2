"""What a checkpoint holds, per gated layer: format, modes, stored bonds, effective ranks, size,
compression.

    print(comera.checkpoint_report("runs/latest/checkpoints/comera.pt"))

Read from the file alone (no model needed): each recorded layer, of any format, is rebuilt from
its record (:mod:`comera.surgery.records`) and its weights, so the effective ranks (gate entries
above tau, one per bond) are the ones the model trains with.
Sizes are counted as :mod:`comera.ranks.size` counts them (``model_size``, ``compression_ratio``
and the run summary agree with this table): a TT layer at its effective ranks with its bias and
its hot-row cache (:class:`~comera.layers.cached_embedding.CachedTTEmbedding`), against the dense
matrix it stands for; every other floating-point tensor counts once, outside the TT layers (a
tied weight, stored under two names on one storage, once).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from comera.surgery.checkpoint import read_checkpoint
from comera.surgery.records import build_layer
from comera.surgery.table import text_table


@dataclass(frozen=True)
class LayerRow:
    """One gated layer of a checkpoint: type, format, dense shape, modes, stored bonds and
    effective ranks (as the layer gives them: a chain's with its ends 1) and parameters (at the
    effective ranks, and dense)."""

    name: str
    kind: str
    shape: tuple[int, int]
    modes: tuple[tuple[int, ...], tuple[int, ...]]
    bonds: tuple[int, ...]  # stored (physical): the layer's ``bonds``
    ranks: tuple[int, ...]  # effective: the layer's ``ranks``
    params: int  # at the effective ranks (bias and hot-row cache included)
    dense_params: int
    cache_params: int = 0  # of a hot-row cache, counted in ``params`` (as model_size does)
    format: str = "tt"
    chain: bool = True  # bonds and ranks carry a chain's ends

    @property
    def bond_sizes(self) -> tuple[int, ...]:
        """The stored size of each bond, in gate order (a chain's ends left out)."""
        return self.bonds[1:-1] if self.chain else self.bonds

    @property
    def bond_ranks(self) -> tuple[int, ...]:
        """The effective size of each bond, in gate order (a chain's ends left out)."""
        return self.ranks[1:-1] if self.chain else self.ranks

    @property
    def compression(self) -> float:
        """Dense parameters / parameters at the effective ranks."""
        return self.dense_params / max(self.params, 1)

    @property
    def removed(self) -> bool:
        """A rank pruned to 0: the layer's weight is gone (its output is the bias alone)."""
        return 0 in self.ranks

    def ratio_text(self) -> str:
        """The compression as printed: "removed" for a removed layer, where a ratio would only
        restate the dense size."""
        return "removed" if self.removed else f"{self.compression:.1f}x"


@dataclass(frozen=True)
class CheckpointReport:
    """A checkpoint's TT layers, its parameters outside them and its ``extra`` data; ``str()``
    prints them as a table with totals."""

    path: str
    layers: tuple[LayerRow, ...]
    other_params: int  # parameters outside the TT layers
    extra: dict[str, Any]

    @property
    def tt_params(self) -> int:
        """Parameters of all TT layers at their effective ranks."""
        return sum(r.params for r in self.layers)

    @property
    def tt_dense_params(self) -> int:
        """Parameters of all TT layers were they dense."""
        return sum(r.dense_params for r in self.layers)

    @property
    def compression(self) -> float:
        """Compression of the TT layers: dense parameters / parameters at the effective ranks
        (1.0 for a checkpoint without TT layers)."""
        if not self.layers:
            return 1.0
        return self.tt_dense_params / max(self.tt_params, 1)

    @property
    def cache_params(self) -> int:
        """Parameters of the hot-row caches, counted with their TT tables."""
        return sum(r.cache_params for r in self.layers)

    def __str__(self) -> str:
        if not self.layers:
            return (f"{self.path}\nno TT layers: a dense checkpoint of {self.other_params:,} "
                    "parameters (comera convert turns a model into TT layers).")
        head = ("layer", "type", "format", "shape", "modes", "bonds", "ranks", "params", "dense",
                "ratio")
        rows = [(r.name, r.kind, r.format, f"{r.shape[0]}x{r.shape[1]}",
                 f"{list(r.modes[0])}x{list(r.modes[1])}", str(list(r.bond_sizes)),
                 str(list(r.bond_ranks)), f"{r.params:,}", f"{r.dense_params:,}", r.ratio_text())
                for r in self.layers]
        all_removed = bool(self.layers) and all(r.removed for r in self.layers)
        rows.append(("TT layers", "", "", "", "", "", "", f"{self.tt_params:,}",
                     f"{self.tt_dense_params:,}",
                     "removed" if all_removed else f"{self.compression:.1f}x"))
        lines = text_table(head, rows)
        total = self.tt_params + self.other_params
        dense_total = self.tt_dense_params + self.other_params
        lines.append(f"whole model: {total:,} parameters ({dense_total:,} dense, "
                     f"{dense_total / max(total, 1):.1f}x); {self.other_params:,} outside the "
                     "TT layers")
        if self.cache_params:
            lines.append(f"hot-row caches: {self.cache_params:,} parameters, counted with their "
                         "TT tables")
        engine = self.extra.get("engine")
        if isinstance(engine, dict):
            lines.append(f"training: step {engine.get('step')}, stage "
                         f"{engine.get('trainer', {}).get('stage')}, task {engine.get('task')}")
        return f"{self.path}\n" + "\n".join(lines)


def checkpoint_report(path: str | os.PathLike) -> CheckpointReport:
    """Per-layer ranks, sizes and compression of a comera checkpoint (checksum verified)."""
    record = read_checkpoint(path)
    state = record.model
    rows, inside = [], set()
    for name, spec in record.layers.items():
        prefix = f"{name}."
        sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        inside.update(prefix + k for k in sub)
        like = next(iter(sub.values()), torch.empty(0))
        layer = build_layer(spec, like)
        layer.load_state_dict(sub)
        layer.tau = float(spec["tau"])
        cache_key = _cache_key(name, state)
        cache = 0
        if cache_key is not None:
            inside.add(cache_key)
            cache = state[cache_key].numel()
        layout = layer.layout
        rows.append(LayerRow(name, type(layer).__name__, (layer.in_features, layer.out_features),
                             (layout.in_modes, layout.out_modes), layer.bonds, layer.ranks,
                             layer.num_parameters(True) + cache, layer.dense_num_parameters(),
                             cache, layer.format.name, layout.is_chain))
    other = sum(v.numel() for k, v in _untied(state).items()
                if k not in inside and not _is_buffer_like(k, v))
    return CheckpointReport(record.path, tuple(rows), other, dict(record.extra))


def _untied(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each tensor that several entries share (a tied weight: GPT-2's
    ``lm_head.weight`` is ``transformer.wte.weight``; torch.save keeps the sharing) kept once,
    under its first name: ``model.parameters()``, and so ``model_size``, count it once."""
    seen, out = set(), {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            tie = (value.untyped_storage().data_ptr(), value.storage_offset(),
                   tuple(value.shape), tuple(value.stride()), value.dtype)
            if tie in seen:
                continue
            seen.add(tie)
        out[key] = value
    return out


def _cache_key(name: str, state: dict[str, Any]) -> str | None:
    """The state key of the hot-row cache around the TT table ``name`` (a CachedTTEmbedding
    stores ``<owner>.tt.*``, ``<owner>.cache`` and ``<owner>.hot_ids``), or None."""
    owner, _, last = name.rpartition(".")
    if last != "tt":
        return None
    prefix = f"{owner}." if owner else ""
    key = f"{prefix}cache"
    return key if key in state and f"{prefix}hot_ids" in state else None


def _is_buffer_like(key: str, value: Any) -> bool:
    """Integer tensors in a state dict are buffers (counters, ids), not parameters."""
    return not (isinstance(value, torch.Tensor) and value.is_floating_point())
