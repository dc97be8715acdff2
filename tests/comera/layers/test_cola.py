"""ColaLinear: ``B (g * act(A x)) + b`` against its explicit formula, its gradients, its gate,
its initial scale, the runtimes (autocast, torch.compile, torch.func), its errors, and a causal
LM built of it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import comera
from comera.errors import ConfigError
from comera.layers.cola import ColaLinear, activation_second_moment
from comera.models.causal_lm import CausalLM, CausalLMConfig
from comera.models.transformer import TransformerConfig, layer_kinds, linear_layer
from comera.ranks.objective import rank_regularizer
from comera.ranks.size import compression_ratio, gated_layers
from comera.ranks.truncate import truncate_

F64 = torch.float64


def explicit(layer: ColaLinear, x: torch.Tensor, act=F.silu) -> torch.Tensor:
    """``B (g * act(A x)) + b`` written out from the stored parameters and scales."""
    (sb, sa), (b, a) = layer.core_scale_values, layer.cores
    gate = layer.gates[0]
    y = (act(x @ (a * sa)) * gate) @ (b * sb)
    return y + layer.bias if layer.bias is not None else y


@pytest.mark.parametrize("parametrization", ["balanced", "plain"])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_is_b_silu_a_x(parametrization, bias):
    torch.manual_seed(0)
    layer = ColaLinear(12, 9, 4, bias=bias, dtype=F64, parametrization=parametrization)
    with torch.no_grad():
        layer.gates[0].copy_(torch.rand(4, dtype=F64) + 0.5)
        if bias:
            layer.bias.normal_()
    for x in (torch.randn(5, 12, dtype=F64), torch.randn(2, 3, 12, dtype=F64)):
        torch.testing.assert_close(layer(x), explicit(layer, x), rtol=1e-13, atol=1e-13)
    assert [tuple(c.shape) for c in layer.cores] == [(4, 9), (12, 4)]  # B first: gates fold in B


def test_the_identity_activation_is_the_lowrank_format():
    """With no nonlinearity the layer is the low-rank layer of the same factors."""
    torch.manual_seed(0)
    cola = ColaLinear(10, 7, 3, activation="identity", dtype=F64, parametrization="plain")
    low = comera.GatedLinear(10, 7, "lowrank", 3, dtype=F64, parametrization="plain")
    with torch.no_grad():
        low.cores[0].copy_(cola.cores[1])
        low.cores[1].copy_(cola.cores[0])
    x = torch.randn(6, 10, dtype=F64)
    torch.testing.assert_close(cola(x), low(x), rtol=1e-13, atol=1e-13)


def test_gradcheck_and_gradgradcheck():
    torch.manual_seed(0)
    layer = ColaLinear(6, 5, 3, dtype=F64)
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(4, 6, dtype=F64, requires_grad=True)
    params = [layer.cores[0], layer.cores[1], layer.gates[0], layer.bias]

    def f(x, b, a, g, bias):
        return functional_call(layer, {"cores.0": b, "cores.1": a, "gates.0": g, "bias": bias},
                               (x,))

    torch.autograd.gradcheck(f, (x, *params))
    torch.autograd.gradgradcheck(f, (x, *params))


def test_a_gate_at_zero_removes_that_rank():
    torch.manual_seed(0)
    layer = ColaLinear(8, 6, 4, dtype=F64)
    x = torch.randn(5, 8, dtype=F64)
    with torch.no_grad():
        layer.gates[0][2] = 0.0
    assert layer.bond_ranks == (3,)
    (sb, sa), (b, a) = layer.core_scale_values, layer.cores
    keep = [0, 1, 3]
    expected = F.silu(x @ (a[:, keep] * sa)) @ (b[keep] * sb) + layer.bias
    torch.testing.assert_close(layer(x), expected, rtol=1e-13, atol=1e-13)
    # a gate below tau counts as zero and passes no gradient
    with torch.no_grad():
        layer.gates[0][1] = layer.tau / 2
    layer(x).sum().backward()
    assert layer.gates[0].grad[1] == 0 and layer.gates[0].grad[0] != 0
    assert layer.bond_ranks == (2,) and layer.num_parameters() == 2 * (8 + 6) + 6
    # truncation cuts the dead slices and folds the gate into B: the function is kept
    model = nn.Sequential(layer)
    before = model(x)
    truncate_(model)
    assert [tuple(c.shape) for c in layer.cores] == [(2, 6), (8, 2)]
    torch.testing.assert_close(model(x), before, rtol=1e-12, atol=1e-12)


def test_the_rank_objective_and_sizes_read_it():
    torch.manual_seed(0)
    model = nn.Sequential(ColaLinear(16, 16, 4, bias=False), nn.GELU(),
                          ColaLinear(16, 16, 2, bias=False))
    assert [name for name, _ in gated_layers(model)] == ["0", "2"]
    assert compression_ratio(model) == pytest.approx(2 * 256 / (4 * 32 + 2 * 32))
    reg = rank_regularizer(model)
    reg.backward()
    assert reg.item() > 0 and all(g.grad is not None and g.grad.abs().sum() > 0
                                  for _, m in gated_layers(model) for g in m.gates)


@pytest.mark.parametrize("activation", ["silu", "gelu", "relu", "identity"])
@pytest.mark.parametrize("parametrization", ["balanced", "plain"])
def test_the_output_scale_at_init_is_nn_linears(activation, parametrization):
    """On inputs of unit variance the output's second moment is nn.Linear's default (1/3):
    B's std carries the activation's gain (without it SiLU's output is about 3x too small)."""
    torch.manual_seed(0)
    x = torch.randn(4096, 256)
    linear = sum(nn.Linear(256, 256)(x).pow(2).mean().item() for _ in range(4)) / 4
    cola = sum(ColaLinear(256, 256, 64, activation, parametrization=parametrization)(x)
               .pow(2).mean().item() for _ in range(4)) / 4
    assert cola == pytest.approx(linear, rel=0.08)
    assert linear == pytest.approx(1 / 3, rel=0.05)


def test_the_second_moment_quadrature():
    assert activation_second_moment("identity", 0.7) == pytest.approx(0.7, rel=1e-12)
    assert activation_second_moment("relu", 0.7) == pytest.approx(0.35, rel=1e-12)
    z = torch.randn(2_000_000, generator=torch.Generator().manual_seed(0), dtype=F64)
    mc = F.silu(z * math.sqrt(0.5)).pow(2).mean().item()
    assert activation_second_moment("silu", 0.5) == pytest.approx(mc, rel=5e-3)


def test_autocast_bf16_agrees_with_float32():
    torch.manual_seed(0)
    layer = ColaLinear(64, 48, 16)
    x = torch.randn(32, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = layer(x)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), layer(x), rtol=3e-2, atol=3e-2)


def test_torch_compile_agrees_with_eager():
    torch.manual_seed(0)
    layer = ColaLinear(32, 24, 8)
    with torch.no_grad():
        layer.gates[0][3] = 0.0
    x = torch.randn(2, 7, 32)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x), rtol=1e-6, atol=1e-6)


def test_torch_func_grad_and_vmap_agree_with_eager():
    torch.manual_seed(0)
    layer = ColaLinear(10, 8, 4)
    params = dict(layer.named_parameters())
    x = torch.randn(6, 10)

    def loss(p, x):
        return functional_call(layer, p, (x,)).pow(2).sum()

    grads = grad(loss)(params, x)
    loss(params, x).backward()
    for name, p in params.items():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-6)
    per_row = vmap(lambda row: functional_call(layer, params, (row,)))(x)
    torch.testing.assert_close(per_row, layer(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"rank": 0}, "rank=0; CoLA's bottleneck is an int >= 1"),
    ({"rank": 2.5}, "rank=2.5"),
    ({"activation": "tanh"}, "activation='tanh'; choose one of 'silu'"),
    ({"parametrization": "muP"}, "parametrization='muP'"),
    ({"in_features": 0}, "in_features=0"),
    ({"tau": 2.0}, "tau=2.0"),
])
def test_bad_settings_are_refused(kwargs, match):
    settings = {"in_features": 8, "out_features": 6, "rank": 2, **kwargs}
    with pytest.raises(ConfigError, match=match):
        ColaLinear(**settings)


def test_bad_inputs_are_refused():
    layer = ColaLinear(8, 6, 2)
    with pytest.raises(ConfigError, match=r"shape \(\.\.\., 8\), got \(3, 7\)"):
        layer(torch.randn(3, 7))
    with pytest.raises(ConfigError, match="no dense weight"):
        layer.format.dense(list(layer.cores), layer.layout)


def test_it_is_a_layer_kind_not_a_format():
    assert "cola" in layer_kinds() and "cola" not in comera.formats.registry.format_names()
    layer = linear_layer("cola", 16, 8, 4, bias=False, parametrization="plain")
    assert type(layer) is ColaLinear and layer.rank == 4 and layer.bias is None
    with pytest.raises(ConfigError, match=r"linear='colla'; choose one of dense, .*cola"):
        CausalLMConfig(linear="colla")
    cfg = TransformerConfig.small(vocab_size=50, linear_format="cola", rank=8)
    model = comera.models.PairClassifier(cfg)
    assert type(model.tokens) is nn.Embedding  # the token table stays dense
    assert isinstance(model.blocks[0].attn.q, ColaLinear)
    ids = torch.randint(1, 50, (2, 9))
    assert model(ids).shape == (2, cfg.n_classes)


def test_a_causal_lm_of_it_trains():
    torch.manual_seed(0)
    cfg = CausalLMConfig(vocab_size=64, d_model=32, n_heads=2, d_ff=64, n_layers=1, max_len=16,
                         linear="cola", rank=8)
    model = CausalLM(cfg)
    assert all(isinstance(m, ColaLinear) for _, m in model.block_linears())
    ids = torch.randint(0, 64, (8, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
