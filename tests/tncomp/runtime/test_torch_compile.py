"""torch.compile: a compiled network is one opaque operator (``tncomp::contract``) to dynamo.

No graph breaks (no file I/O, plan lookups or data-dependent Python in the traced region), one
node per call, ``fullgraph=True`` works, and forward and backward equal eager mode.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn

import tncomp
from tests.helpers.tn import compile_net, operands, reference
from tncomp.runtime.library import contract_op

TOL = {"rtol": 1e-9, "atol": 1e-10}


def _prebuild(model: nn.Module) -> None:
    """Build every TT layer's compiled network before tracing (creating one is not traced)."""
    for layer in model.modules():
        if hasattr(layer, "compiled"):
            layer.compiled()


def _mlp(d_in=32, d_hidden=64, dtype=torch.float64) -> nn.Module:
    import comera

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_in))
    comera.convert_(model, ranks=4)
    model = model.to(dtype)
    _prebuild(model)
    return model


def _contract_nodes(gm: torch.fx.GraphModule, op: str = "contract") -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function"
               and str(n.target) == f"tncomp.{op}.default")


def test_operator_passes_opcheck():
    net = tncomp.tt_linear([2, 3], [3, 2], 2)
    f = compile_net(net)
    ts = operands(net, 3, seed=0, requires_grad=True)
    torch.library.opcheck(contract_op, (f.op_id, [True] * len(ts), ts),
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))


def test_converted_mlp_has_no_graph_breaks_and_one_node_per_layer(one_thread):
    model = _mlp()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(torch.randn(4, 32, dtype=torch.float64))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    # with gradients the forward hands its intermediates to the backward (no recomputation)
    assert _contract_nodes(explained.graphs[0], "contract_saving") == 2
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(torch.randn(4, 32, dtype=torch.float64))
    assert explained.graph_break_count == 0
    assert _contract_nodes(explained.graphs[0], "contract") == 2


@pytest.mark.parametrize("backend", ["eager", pytest.param("aot_eager", marks=pytest.mark.slow)])
def test_fullgraph_training_step_equals_eager(backend, one_thread):
    """backend "eager" runs the operator's registered autograd; "aot_eager" also traces the
    backward operator through its fake implementation."""
    model = _mlp()
    x = torch.randn(6, 32, dtype=torch.float64)

    def step(m):
        m.zero_grad()
        loss = m(x).sin().sum()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters()]

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    loss_c, grads_c = step(compiled)
    loss_e, grads_e = step(model)
    torch.testing.assert_close(loss_c, loss_e, **TOL)
    for c, e in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(c, e, **TOL)


def test_dynamic_batch_sizes(one_thread):
    """Symbolic batch sizes: the fake implementation needs no plan, each real call gets its own."""
    net = tncomp.tt_linear([2, 3], [3, 2], 2)
    f = compile_net(net)
    cores = operands(net, 1, seed=1)[1:]
    fn = torch.compile(lambda x: f(x, *cores), dynamic=True, fullgraph=True, backend="eager")
    torch._dynamo.reset()
    for b in (2, 5, 9):
        x = torch.randn(b, 2, 3, dtype=torch.float64)
        torch.testing.assert_close(fn(x), reference(net, [x, *cores]), **TOL)


@pytest.mark.slow
def test_inductor_training_step_equals_eager(one_thread):
    model = _mlp(dtype=torch.float32)
    x = torch.randn(6, 32)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    for m in (compiled, model):
        m.zero_grad()
        m(x).pow(2).sum().backward()
        if m is compiled:
            want = [p.grad.clone() for p in model.parameters()]
    for g, p in zip(want, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_project_transformer_has_no_graph_breaks(one_thread):
    from comera.models.transformer import PairClassifier, TransformerConfig

    torch.manual_seed(0)
    cfg = TransformerConfig.small(vocab_size=64, tt_embedding=False, dropout=0.0)
    model = PairClassifier(cfg)
    _prebuild(model)
    ids = torch.randint(1, 64, (2, 12))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-6)


def test_autocast_inside_compiled_function_matches_eager_autocast(one_thread):
    net = tncomp.tt_linear([2, 3], [3, 2], 2)
    f = compile_net(net)
    ts = operands(net, 4, seed=3, dtype=torch.float32, requires_grad=True)

    def g(*xs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return f(*xs)

    torch._dynamo.reset()
    got = torch.compile(g, fullgraph=True, backend="eager")(*ts)
    want = g(*ts)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
    (gx,) = torch.autograd.grad(got.float().sum(), ts[1])
    (wx,) = torch.autograd.grad(want.float().sum(), ts[1])
    assert gx.dtype == torch.float32
    torch.testing.assert_close(gx, wx)


@pytest.mark.parametrize("which", ["tucker", "btt"])
def test_strided_batch_plans_compile_whole_and_equal_einsum(which, one_thread):
    """The layout-aware plans (strided-batch GEMMs, adjoints read in place) under
    ``torch.compile(fullgraph=True)``: one graph, einsum's values and gradients (float64)."""
    from tests.tncomp.compiler.test_layouts import btt, tucker

    net = tucker((3, 2, 2), (2, 3, 2), 2) if which == "tucker" else btt((3, 2, 2), (2, 3, 2), 2)
    f = compile_net(net)
    compiled = torch.compile(lambda *ts: f(*ts), fullgraph=True, backend="aot_eager")
    ts = operands(net, 300, requires_grad=True)
    y = compiled(*ts)
    expected = reference(net, ts)
    torch.testing.assert_close(y, expected)
    dy = torch.randn_like(y)
    for got, want in zip(torch.autograd.grad(y, ts, dy), torch.autograd.grad(expected, ts, dy),
                         strict=True):
        torch.testing.assert_close(got, want)
