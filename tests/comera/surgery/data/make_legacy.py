"""Writes the legacy fixtures of test_legacy.py: a checkpoint and a save_pretrained folder in the
record shape comera wrote before the format protocol (kinds TTLinear / TTMLinear / TTEmbedding
with modes and chain bonds). They were written with main's record code of c57ff6a (p2 at 9845fa2,
records untouched); this script is kept to say how, and writes the new record shape when run
with today's code.

    PYTHONPATH=$PWD python tests/comera/surgery/data/make_legacy.py
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import comera
from tests.comera.surgery.test_checkpoint import Net  # the same model the checkpoint tests use

HERE = Path(__file__).parent
F64 = torch.float64


def trained() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """A converted (TT, TT-matrix, TT embedding), trained and truncated model."""
    torch.manual_seed(0)
    model = Net()
    comera.convert_(model, include=["emb", "a"], embedding=True, ranks=6)
    comera.convert_(model, include=["b"], ranks=4, format="ttm")
    opt = comera.make_optimizer(model)
    ids = torch.randint(0, 30, (5, 4))
    for _ in range(3):
        opt.zero_grad()
        model(ids).square().mean().backward()
        opt.step()
    with torch.no_grad():
        for _, layer in comera.tt_modules(model):
            for gate in layer.gates:
                if gate.numel() > 1:
                    gate[-1] = 0.5 * layer.tau
    comera.truncate_(model, opt)
    return model, opt, ids


if __name__ == "__main__":
    model, opt, ids = trained()
    with torch.no_grad():
        y = model(ids)
    comera.save_checkpoint(HERE / "legacy_checkpoint.pt", model, opt, ids=ids, y=y)
    comera.save_pretrained(model, HERE / "legacy_pretrained")
    torch.save({"ids": ids, "y": y}, HERE / "legacy_pretrained_expected.pt")
