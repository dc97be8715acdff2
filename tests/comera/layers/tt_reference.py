"""What the TT and TT-matrix layers compute, for fixed seeds: the bit-identity reference.

:func:`compute` runs initialisation, forward and backward, the regularisers, ``soft_size``,
saliency, pruning with rounding, rounding, spectrum allocation, truncation with Adam state,
``from_linear`` / ``from_embedding`` and the captured step's size on small float32 layers, and
returns every tensor it saw. ``data/tt_reference.pt`` holds what it returned on main before the
layers became generic over a format's layout (commit c57ff6a); ``test_tt_bit_identity`` checks
that it still returns the same bits (the layers built with ``parametrization="plain"``, what
every layer was before issue 30). Regenerate only for an intended numerical change:
``PYTHONPATH=$PWD python -m tests.comera.layers.tt_reference``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import comera
from comera import TTEmbedding, TTLinear, TTMLinear
from comera.layers.siblings import Siblings
from comera.ranks import objective, truncate
from comera.ranks.allocate import allocate_, bond_spectra
from comera.training.capture import _tensor_size

FIXTURE = Path(__file__).parent / "data" / "tt_reference.pt"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = TTLinear(12, 20, (2, 2, 3), (2, 2, 5), ranks=4, parametrization="plain")
        self.b = TTMLinear(20, 6, (4, 5), (3, 2), ranks=5, parametrization="plain")
        self.emb = TTEmbedding(50, 12, ranks=3)

    def forward(self, x, ids):
        return self.b(torch.tanh(self.a(x + self.emb(ids))))


def _gates_(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in comera.gated_layers(model):
            for k, gate in enumerate(layer.gates):
                gate.copy_(torch.rand(gate.shape, generator=g) * 1.5 - 0.25)
                if gate.numel() > 2:
                    gate[k % gate.numel()] = 0.5 * layer.tau


def _record(out, prefix, model):
    for name, p in model.named_parameters():
        out[f"{prefix}.param.{name}"] = p.detach().clone()


def compute() -> dict[str, torch.Tensor]:
    """Every tensor of the reference run (see the module docstring), on one thread (a matmul's
    blocking, and so its bits, follows the thread count; other tests change it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _compute()
    finally:
        torch.set_num_threads(threads)


def _compute() -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    torch.manual_seed(0)
    model = Net()
    _record(out, "init", model)
    _gates_(model, 1)
    x = torch.randn(5, 12)
    ids = torch.randint(0, 50, (5,))
    y = model(x, ids)
    out["forward"] = y.detach().clone()
    (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
    for name, p in model.named_parameters():
        out[f"grad.{name}"] = p.grad.detach().clone()
    model.zero_grad()
    for kind in objective.REGULARIZERS:
        reg = objective.rank_regularizer(model, kind)
        reg.backward()
        out[f"reg.{kind}"] = reg.detach().clone()
        for name, p in model.named_parameters():
            if p.grad is not None:
                out[f"reg.{kind}.grad.{name}"] = p.grad.detach().clone()
        model.zero_grad()
    soft = objective.soft_size(model)
    soft.backward()
    out["soft_size"] = soft.detach().clone()
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[f"soft.grad.{name}"] = p.grad.detach().clone()
    model.zero_grad()
    out["model_size"] = torch.tensor(comera.model_size(model))
    out["tensor_size"] = _tensor_size(model, 7).detach().clone()
    for name, layer in comera.gated_layers(model):
        for k in range(len(layer.gates)):
            out[f"saliency.{name}.{k}"] = objective._saliency(layer, k).clone()
        out[f"dense.{name}"] = layer.to_dense().detach().clone()
        out[f"ranks.{name}"] = torch.tensor(layer.ranks)
        out[f"rounded.{name}"] = torch.tensor(objective.rounded_ranks(layer))
        out[f"floor.{name}"] = torch.tensor(objective.floor_size(model, 2))

    # Adam state, then pruning with rounding, then truncation
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(x, ids).square().mean().backward()
        opt.step()
    pruned = objective.prune_to_(model, 0.8 * comera.model_size(model), rounding=True,
                                 optimizer=opt)
    out["pruned"] = torch.tensor([i for _, i in pruned])
    _record(out, "pruned", model)
    report = comera.truncate_(model, opt)
    out["truncated.bonds"] = torch.tensor([b for _, _, after in report.layers for b in after])
    _record(out, "truncated", model)
    for name, p in model.named_parameters():
        for key, value in opt.state[p].items():
            out[f"adam.{name}.{key}"] = value.clone()
    out["truncated.forward"] = model(x, ids).detach().clone()

    # rounding and spectrum allocation on a fresh model
    torch.manual_seed(2)
    model = Net()
    _gates_(model, 3)
    for name, layer in comera.gated_layers(model):
        for k, s in enumerate(bond_spectra(layer)):
            out[f"spectrum.{name}.{k}"] = s.clone()
        out[f"excess.{name}"] = torch.tensor([*truncate.excess_bonds(layer), -1])
    truncate.round_(model, only_excess=False)
    _record(out, "rounded", model)
    allocation = allocate_(model, 0.8 * comera.model_size(model))
    out["allocation"] = torch.tensor([r for ranks in allocation.ranks.values() for r in ranks])
    _record(out, "allocated", model)

    # siblings: q, k, v of different ranks stacked into one contraction (zero-padded bonds)
    torch.manual_seed(5)
    qkv = [TTLinear(12, 12, (3, 4), (4, 3), ranks=r, parametrization="plain")
           for r in (4, 3, 2)]
    xs = torch.randn(3, 12)
    ys = Siblings()(qkv, xs)
    sum((y * (i + 1)).sum() for i, y in enumerate(ys)).backward()
    for i, (layer, y) in enumerate(zip(qkv, ys, strict=True)):
        out[f"siblings.{i}"] = y.detach().clone()
        for name, p in layer.named_parameters():
            out[f"siblings.{i}.grad.{name}"] = p.grad.detach().clone()

    # initialisation from dense weights
    torch.manual_seed(4)
    linear = nn.Linear(12, 20)
    _record(out, "from_linear.tt", TTLinear.from_linear(linear, ranks=3,
                                                           parametrization="plain"))
    _record(out, "from_linear.ttm", TTMLinear.from_linear(linear, ranks=3,
                                                             parametrization="plain"))
    _record(out, "from_linear.full", TTLinear.from_linear(linear, ranks=64,
                                                             parametrization="plain"))
    table = nn.Embedding(50, 12)
    _record(out, "from_embedding", TTEmbedding.from_embedding(table, ranks=3))
    return out


if __name__ == "__main__":
    FIXTURE.parent.mkdir(exist_ok=True)
    torch.save(compute(), FIXTURE)
    print(f"wrote {FIXTURE}")
