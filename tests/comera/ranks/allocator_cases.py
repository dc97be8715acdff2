"""Fixed inputs of the two rank allocations (the late stage's spectrum allocation and
``convert_``'s global budget), shared by the bit-identity tests that pin their results."""

from __future__ import annotations

import torch
from torch import nn

from comera import TTLinear, TTMLinear
from comera.formats.registry import get_format
from comera.ranks.global_budget import LayerSpectra

F64 = torch.float64


def chain_model() -> nn.Sequential:
    """Three TT layers and a TT-matrix layer holding decaying weights at rank 8 (float64)."""
    gen = torch.Generator().manual_seed(0)
    layers = []
    for k, cls in enumerate((TTLinear, TTLinear, TTLinear, TTMLinear)):
        u, _ = torch.linalg.qr(torch.randn(64, 64, generator=gen, dtype=F64))
        v, _ = torch.linalg.qr(torch.randn(64, 64, generator=gen, dtype=F64))
        s = torch.logspace(0, -(k + 1), 64, dtype=F64)
        linear = nn.Linear(64, 64, bias=k % 2 == 0, dtype=F64)
        with torch.no_grad():
            linear.weight.copy_((u * s) @ v.T)
        layers.append(cls.from_linear(linear, ranks=8, in_modes=(4, 4, 4), out_modes=(4, 4, 4)))
    return nn.Sequential(*layers)


def budget_layers() -> list[LayerSpectra]:
    """Layers of four formats (lowrank, tt, ttm, tucker) with decaying spectra, as convert_'s
    global budget sees them (plain spectra)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for k, (fmt, ins, outs) in enumerate((("lowrank", (48,), (32,)), ("tt", (4, 8), (4, 6)),
                                          ("ttm", (4, 8), (6, 4)), ("tucker", (4, 6), (6, 4)))):
        n_in, n_out = (torch.tensor(ins).prod().item(), torch.tensor(outs).prod().item())
        weight = torch.randn(n_in, n_out, generator=gen, dtype=F64)
        u, s, vh = torch.linalg.svd(weight, full_matrices=False)
        weight = (u * s * torch.logspace(0, -2, s.numel(), dtype=F64)) @ vh
        f = get_format(fmt)
        layout = f.layout(ins, outs, 1)
        out.append(LayerSpectra(f"{fmt}{k}", layout, tuple(f.spectra(weight, layout))))
    return out
