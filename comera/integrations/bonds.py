"""Load a truncated model's weights into a model built at its original ranks.

A truncated TT layer's cores are smaller than a freshly built one's, so a plain
``load_state_dict`` of its weights fails on the shapes. Trainers that resume by
``model.load_state_dict(saved)`` (HuggingFace ``Trainer``'s ``resume_from_checkpoint``,
Lightning's ``ckpt_path``) therefore get a pre-hook on every TT layer: before the layer loads, it
takes the bonds of the incoming cores (new, uninitialised parameters where they differ). Build
the optimizer after loading (both trainers do), since resized layers hold new parameters.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from comera.ranks.size import gated_layers

# a zero-size tensor under a converted layer's dense weight name: HuggingFace's own
# from_pretrained meets it as a size mismatch and refuses the checkpoint, instead of
# re-initialising the layer densely; the hooks below drop it again
SENTINEL = "weight"


def _take_saved_bonds(module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    marker = state_dict.get(prefix + SENTINEL)
    if marker is not None and marker.numel() == 0:
        del state_dict[prefix + SENTINEL]
    shapes = [state_dict.get(f"{prefix}cores.{k}") for k in range(len(module.cores))]
    if any(s is None for s in shapes):
        return  # not this layer's weights: the load reports the missing keys itself
    sizes = tuple(int(shapes[c].shape[axis]) for c, axis in module.gate_folds())
    if sizes != module.bond_sizes:
        module.resize_bonds_(sizes)


def follow_saved_bonds_(model: nn.Module) -> list[RemovableHandle]:
    """Make every TT layer of ``model`` take the bonds of the weights it loads (see the module
    docstring); returns the hooks' handles (``handle.remove()`` undoes it)."""
    return [layer.register_load_state_dict_pre_hook(_take_saved_bonds)
            for _, layer in gated_layers(model)]
