"""Dropout that keeps a one-byte mask for the backward.

On the CPU ``nn.Dropout`` draws its mask as a float tensor and saves it for the backward: four
bytes per activation, the size of the activation itself. ``torch.native_dropout`` (what CUDA
runs anyway) draws the same mask from the same random numbers and keeps it as bool, one byte.
Outputs, gradients and the random stream after it are bit-identical to ``nn.Dropout``
(``tests/comera/models/test_dropout.py``); in the paper transformer at batch 1 the float masks
of the residual and FFN dropouts were 13.5 MiB of CoMERA's 86 MiB step peak.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class BoolMaskDropout(nn.Dropout):
    """``nn.Dropout`` whose backward keeps a bool mask (same results, a quarter of the bytes).

    Under ``torch.compile`` and torch.func transforms it is plain ``nn.Dropout``: those trace or
    batch their own random ops."""

    def forward(self, x: Tensor) -> Tensor:
        if (not self.training or self.inplace or not 0 < self.p < 1
                or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()):
            return super().forward(x)
        return torch.native_dropout(x, self.p, True)[0]
