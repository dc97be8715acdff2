"""Checks every format's test runs: its compiled network, its dense reconstruction and
``torch.einsum`` of its equation agree on random float64 inputs, forward and backward."""

from __future__ import annotations

import torch
from torch import Tensor

import tncomp
from comera.formats.layout import Layout
from comera.formats.registry import Format


def random_cores(layout: Layout, gen: torch.Generator) -> list[Tensor]:
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in
            layout.core_shapes]


def check_network(fmt: Format, layout: Layout, gen: torch.Generator, batch: int = 3) -> None:
    """compiled(x, *cores) == x @ layout.dense(cores) == einsum(layout.equation()), and the
    compiled backward passes gradcheck."""
    cores = random_cores(layout, gen)
    x = torch.randn(batch, *layout.in_modes, generator=gen, dtype=torch.float64)
    compiled = tncomp.compile(fmt.network(layout), disk_cache=False)
    y = compiled(x, *cores)
    assert tuple(y.shape) == (batch, *layout.out_modes)
    dense = x.reshape(batch, -1) @ layout.dense(cores)
    torch.testing.assert_close(y.reshape(batch, -1), dense, rtol=1e-12, atol=1e-12)
    by_einsum = torch.einsum(layout.equation(), x, *cores)
    torch.testing.assert_close(y, by_einsum, rtol=1e-12, atol=1e-12)
    inputs = [t.clone().requires_grad_(True) for t in (x, *cores)]
    assert torch.autograd.gradcheck(lambda *ts: compiled(*ts), inputs)


def dense_out(layer, x: Tensor) -> Tensor:
    """``x @ W + b`` with W the layer's dense reconstruction (gates folded in)."""
    y = x @ layer.layout.dense(layer.gated_cores())
    return y + layer.bias if layer.bias is not None else y


def check_layer(layer, gen: torch.Generator) -> None:
    """A float64 gated layer equals its dense reconstruction, forward and gradients (of x,
    cores, gates and bias), with random gates and one pruned slice per bond."""
    with torch.no_grad():
        for gate in layer.gates:
            gate.copy_(torch.rand(gate.shape, generator=gen, dtype=gate.dtype) + 0.5)
            if gate.numel() > 1:
                gate[0] = 0.0
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen, dtype=torch.float64))
    x = torch.randn(4, layer.in_features, generator=gen, dtype=torch.float64,
                    requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, dense_out(layer, x), rtol=1e-12, atol=1e-12)
    t = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    params = [x, *layer.parameters()]
    got = torch.autograd.grad((y * t).sum(), params)
    want = torch.autograd.grad((dense_out(layer, x) * t).sum(), params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def check_pruned_slices_leave(layer, prune: dict[int, list[int]], gen: torch.Generator) -> None:
    """Gates at or below tau on ``prune`` (bond -> slices) give the function of the layout with
    those slices cut from every core that carries the bond (gates folded, live slices kept)."""
    with torch.no_grad():
        for k, slices in prune.items():
            layer.gates[k][slices] = 0.5 * layer.tau
    x = torch.randn(3, layer.in_features, generator=gen, dtype=torch.float64)
    y = layer(x)
    cores = [c.detach().clone() for c in layer.effective_cores()]
    for k, bond in enumerate(layer.layout.bonds):
        gate = layer.gates[k].detach().clone()
        c, axis = layer.layout.carriers(bond)[0]
        shape = [1] * cores[c].dim()
        shape[axis] = -1
        cores[c] = cores[c] * gate.reshape(shape)
        keep = torch.tensor([s for s in range(gate.numel()) if s not in prune.get(k, [])])
        for c, axis in layer.layout.carriers(bond):
            cores[c] = cores[c].index_select(axis, keep)
    cut = layer.layout.resized({b: int(cores[layer.layout.carriers(b)[0][0]].shape[
        layer.layout.carriers(b)[0][1]]) for b in layer.layout.bonds})
    want = x @ cut.dense(cores) + (layer.bias if layer.bias is not None else 0)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)


def check_truncate(layer, prune: dict[int, list[int]], gen: torch.Generator) -> None:
    """After an Adam step and pruning, ``comera.truncate_`` keeps the function, shrinks the
    pruned bonds in every carrier, and leaves Adam's state shaped like the new parameters."""
    import comera

    opt = torch.optim.Adam(layer.parameters(), lr=1e-3)
    x = torch.randn(3, layer.in_features, generator=gen, dtype=torch.float64)
    layer(x).square().sum().backward()
    opt.step()
    with torch.no_grad():
        for k, slices in prune.items():
            layer.gates[k][slices] = 0.0
    before = layer(x).detach()
    sizes = layer.bond_sizes
    comera.truncate_(layer, opt)
    assert layer.bond_sizes == tuple(s - len(prune.get(k, [])) for k, s in enumerate(sizes))
    assert layer.layout.core_shapes == tuple(tuple(c.shape) for c in layer.cores)
    torch.testing.assert_close(layer(x), before, rtol=1e-12, atol=1e-12)
    params = list(layer.parameters())
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in params}
    for p in params:
        state = opt.state[p]
        assert state["exp_avg"].shape == p.shape and state["exp_avg_sq"].shape == p.shape
    layer(x).square().sum().backward()
    opt.step()  # the optimizer runs on the new parameters
