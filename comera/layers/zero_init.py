"""Zero the output of a residual branch at initialisation: the branch starts as the identity's
complement (``x + f(x) = x``) and grows from there, as GPT-2's and muP's zero-initialised
output projections, and as Qiu et al. 2024 ("Compute Better Spent") start BTT's residual
branches: the last core of each branch's output layer at zero.

Every registered format computes W as one contraction of all its cores (a product, a sum of
products, a trace), so one zero core makes W exactly zero; the last core in the layout's order is
the one that produces the outputs (BTT: the core carrying every output mode; a chain: the core
with the last output mode; low-rank: B). Its gradient at the first step is not zero (the other
cores are not), so it moves first and the rest follow.

Pick the layers yourself: which of a model's layers end a residual branch is the model's
knowledge (a GPT block's attention output and FFN output layers).
"""

from __future__ import annotations

import torch
from torch import nn

from comera.errors import ConfigError
from comera.layers.linear import GatedLayer

__all__ = ["zero_output_"]


def zero_output_(layer: nn.Module) -> nn.Module:
    """Make ``layer`` output zero for every input: a gated layer's last core (layout order) and
    its bias, or an ``nn.Linear``'s weight and bias, set to zero in place. Returns ``layer``."""
    if isinstance(layer, GatedLayer):
        target = layer.cores[-1]
    elif isinstance(layer, nn.Linear):
        target = layer.weight
    else:
        raise ConfigError(f"zero_output_: got a {type(layer).__name__}; give a gated layer "
                          "(GatedLinear, TTLinear ...) or an nn.Linear, the layer that ends a "
                          "residual branch.")
    if target.is_meta:
        raise ConfigError(f"zero_output_: the {type(layer).__name__}'s parameters are on the "
                          "meta device (no values); materialise the model (to_empty and its "
                          "initialisation) first, then zero its output layers.")
    with torch.no_grad():
        target.zero_()
        if layer.bias is not None:
            layer.bias.zero_()
    return layer
