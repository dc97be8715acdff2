"""Tensors that autograd keeps as a recipe and rebuilds in the backward, instead of holding them.

A layer that consumes a tensor often saves it for its backward: the FFN's second linear layer
keeps its input, the dropout of GELU's output, which lives from the forward to the end of the
backward (48 MiB per encoder block in the paper transformer at batch 32). When that tensor is
cheap to rebuild from tensors autograd holds anyway (GELU's input and the dropout's bool mask;
the embedding's tables and digits), :func:`recomputed_in_backward` saves the recipe instead and
the backward runs it: the rebuilt values are the same ops on the same inputs, bit for bit.

It stands aside (everything saved as usual) where a saved-tensor hook cannot be added safely:
when autograd does not record, when hooks are disabled (torch.func transforms), and when
another saved-tensor hook is active (``save_on_cpu``, non-reentrant checkpointing of an
enclosing region, a byte count): an inner hook would take the enclosing one's place, and a
recipe would keep its inputs alive inside a checkpointed region that means to drop them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

Recipe = Callable[[], Tensor]


class _Rebuild:
    """What autograd keeps instead of a view of a recomputable tensor: the recipe (shared by
    every view of that tensor, run once) and where in the rebuilt tensor the view lies."""

    __slots__ = ("offset", "size", "source", "stride")

    def __init__(self, source: _Source, saved: Tensor):
        self.source, self.size, self.stride = source, saved.shape, saved.stride()
        self.offset = saved.storage_offset()

    def unpack(self) -> Tensor:
        return self.source.tensor().as_strided(self.size, self.stride, self.offset)


class _Source:
    """One recomputable tensor's recipe and, once run, its result (kept while any saved view of
    it is, as autograd would keep the tensor itself)."""

    __slots__ = ("built", "recipe", "version")

    def __init__(self, recipe: Recipe, version: int):
        self.recipe, self.built, self.version = recipe, None, version

    def tensor(self) -> Tensor:
        if self.built is None:
            built = self.recipe()
            self.built = built if _owns_its_storage(built) else built.clone(
                memory_format=torch.contiguous_format)
        return self.built


def hooks_available() -> bool:
    """Whether a saved-tensor hook added now would see what autograd saves: it records, hooks are
    enabled (torch.func disables them) and no other saved-tensor hook is active."""
    hooks = torch._C._autograd
    top = getattr(hooks, "_top_saved_tensors_default_hooks", None)
    enabled = getattr(hooks, "_saved_tensors_hooks_is_enabled", None)
    return (torch.is_grad_enabled() and top is not None and top(False) is None
            and enabled is not None and enabled())


def _owns_its_storage(t: Tensor) -> bool:
    """``t`` is contiguous and spans its whole storage, so any view into that storage is a view
    of ``t`` (and of its rebuilt copy at the same offsets)."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _key(t: Tensor) -> tuple:
    return t.untyped_storage().data_ptr(), t.dtype, t.device


@contextlib.contextmanager
def recomputed_in_backward(recipes: Sequence[tuple[Tensor, Recipe]]) -> Iterator[None]:
    """While open: whatever autograd saves that is ``t`` or a view of it, for each
    ``(t, recipe)``, is kept as ``recipe`` and rebuilt in the backward (once per ``t``).

    ``recipe()`` must return ``t``'s values from tensors autograd keeps anyway (so no bytes are
    added); it runs under the backward's grad mode, so double backward differentiates through
    it. Saved as usual: tensors that do not own their storage (or have none: meta), ``t`` once
    it has been changed in place (the recipe would rebuild the old values), and every tensor
    while hooks are unavailable (:func:`hooks_available`)."""
    sources = {_key(t): _Source(recipe, t._version) for t, recipe in recipes
               if t.requires_grad and t.layout == torch.strided and t.numel() > 0
               and t.device.type != "meta" and _owns_its_storage(t)} if hooks_available() else {}
    if not sources:
        yield
        return

    # ``recipes`` (a local of this frame until the block closes) keeps every ``t`` alive, so no
    # other tensor can take its storage and be mistaken for a view of it.
    def pack(t: Tensor):
        try:
            found = sources.get(_key(t)) if t.layout == torch.strided else None
        except (NotImplementedError, RuntimeError):  # no storage to compare (wrapper subclasses)
            return t
        if found is None or t._version != found.version:  # views share the version counter
            return t
        return _Rebuild(found, t)

    def unpack(saved):
        return saved.unpack() if isinstance(saved, _Rebuild) else saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
