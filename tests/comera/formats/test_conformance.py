"""Every registered format passes the same checks: a new format gets them by registering.

Per format (float64 unless said): the layer equals its dense reconstruction, forward and
gradients; gradcheck; conversion from a dense layer at full rank reproduces it (formats with an
exact decomposition); a zeroed gate entry prunes a slice (size and function both follow);
``truncate_`` keeps the function and slices Adam's state to the new shapes; ``round_`` (formats
with a rounding) keeps the function and never grows a bond; a checkpoint round trip; ``convert_``
of an MLP; an early then late stage under :class:`comera.RankController` lands on its target.
Every format that holds embedding tables (:func:`comera.formats.registry.table_formats`) passes
the table checks too: lookups equal the dense rows (forward, gradients, gradcheck), the padding
row is zero, full-rank conversion of a trained table, pruning and truncation, ``convert_`` of an
``nn.Embedding``, checkpoints, autocast and torch.compile.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import comera
from comera.formats.registry import Format, format_names, get_format, table_formats
from comera.layers.embedding import (
    GatedEmbedding,
    embedding_class,
    gated_embedding,
    table_format,
)
from comera.layers.linear import GatedLinear
from comera.ranks.size import model_size
from comera.ranks.truncate import round_

FORMATS = [name for name in format_names() if get_format(name).from_modes]
IN, OUT = 12, 20  # 12 = 2*2*3, 20 = 2*2*5: three modes a side


def _layer(fmt: str, ranks=3, seed: int = 0) -> GatedLinear:
    torch.manual_seed(seed)
    return GatedLinear(IN, OUT, format=fmt, ranks=ranks, d=3, dtype=torch.float64)


def _dense_out(layer: GatedLinear, x: torch.Tensor) -> torch.Tensor:
    w = layer.to_dense()  # (out, in), as nn.Linear stores it
    return x @ w.T + (layer.bias if layer.bias is not None else 0)


@pytest.fixture(params=FORMATS)
def fmt(request) -> str:
    return request.param


def test_registry_lists_every_format():
    assert {"tt", "ttm"} <= set(format_names())
    for name in FORMATS:
        assert get_format(name).name == name


def test_layer_equals_its_dense_reconstruction(fmt):
    layer = _layer(fmt)
    with torch.no_grad():
        for g in layer.gates:  # gates other than one, so folding them in is exercised
            g.uniform_(0.5, 1.5)
    x = torch.randn(5, IN, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    ref = _dense_out(layer, x)
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *layer.cores, *layer.gates], g)
    ref_grads = torch.autograd.grad(ref, [x, *layer.cores, *layer.gates], g)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_gradcheck(fmt):
    layer = _layer(fmt, ranks=2)
    names = [name for name, _ in layer.named_parameters()]
    values = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    x = torch.randn(3, IN, dtype=torch.float64, requires_grad=True)

    def run(x, *values):
        return torch.func.functional_call(layer, dict(zip(names, values, strict=True)), (x,))

    assert torch.autograd.gradcheck(run, (x, *values))


def test_full_rank_conversion_reproduces_the_linear(fmt):
    if not get_format(fmt).exact_decomposition:
        pytest.skip(f"{fmt} has no exact decomposition")
    torch.manual_seed(1)
    linear = nn.Linear(IN, OUT, dtype=torch.float64)
    layer = GatedLinear.from_linear(linear, format=fmt, ranks=10_000)
    x = torch.randn(4, IN, dtype=torch.float64)
    torch.testing.assert_close(layer(x), linear(x), rtol=1e-9, atol=1e-10)


def test_a_zeroed_gate_entry_prunes_a_slice(fmt):
    layer = _layer(fmt, ranks=3)
    before = layer.num_parameters()
    with torch.no_grad():
        layer.gates[0][0] = 0.0
    assert layer.num_parameters() < before
    x = torch.randn(4, IN, dtype=torch.float64)
    torch.testing.assert_close(layer(x), _dense_out(layer, x), rtol=1e-10, atol=1e-12)


def test_truncate_keeps_the_function_and_the_optimizer_state(fmt):
    layer = _layer(fmt, ranks=3)
    model = nn.Sequential(layer)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(4, IN, dtype=torch.float64)
    model(x).square().sum().backward()
    opt.step()
    with torch.no_grad():
        layer.gates[0][-1] = 0.0
    expected = model(x).detach()
    size = model_size(model)
    comera.truncate_(model, opt)
    torch.testing.assert_close(model(x), expected, rtol=1e-10, atol=1e-12)
    assert model_size(model) == size
    assert layer.layout.core_shapes == tuple(tuple(c.shape) for c in layer.cores)
    for p in model.parameters():
        for value in opt.state.get(p, {}).values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert value.shape == p.shape
    model(x).sum().backward()  # the optimizer still steps the new parameters
    opt.step()


def test_round_keeps_the_function(fmt):
    if type(get_format(fmt)).round is Format.round:
        pytest.skip(f"{fmt} has no exact rounding")
    layer = _layer(fmt, ranks=4)
    x = torch.randn(4, IN, dtype=torch.float64)
    expected = layer(x).detach()
    ranks = layer.bond_ranks
    round_(nn.Sequential(layer), only_excess=False)
    torch.testing.assert_close(layer(x), expected, rtol=1e-8, atol=1e-10)
    assert all(a <= b for a, b in zip(layer.bond_ranks, ranks, strict=True))


def test_checkpoint_round_trip(fmt, tmp_path):
    model = nn.Sequential(_layer(fmt, ranks=3, seed=2))
    with torch.no_grad():
        model[0].gates[0][0] = 0.0
    comera.truncate_(model)
    path = tmp_path / "m.pt"
    comera.save_checkpoint(path, model)
    fresh = nn.Sequential(_layer(fmt, ranks=3, seed=3))
    comera.load_checkpoint(path, fresh)
    x = torch.randn(4, IN, dtype=torch.float64)
    torch.testing.assert_close(fresh(x), model(x))
    assert fresh[0].layout == model[0].layout


def test_convert_an_mlp(fmt):
    torch.manual_seed(4)
    mlp = nn.Sequential(nn.Linear(IN, OUT), nn.ReLU(), nn.Linear(OUT, IN)).double()
    x = torch.randn(4, IN, dtype=torch.float64)
    expected = mlp(x).detach()
    comera.convert_(mlp, comera.ConvertConfig(format=fmt, ranks=10_000))
    assert all(isinstance(mlp[k], GatedLinear) and mlp[k].format.name == fmt for k in (0, 2))
    if get_format(fmt).exact_decomposition:
        torch.testing.assert_close(mlp(x), expected, rtol=1e-8, atol=1e-9)


def test_early_and_late_stage_land_on_the_target(fmt):
    torch.manual_seed(5)
    teacher = nn.Linear(IN, OUT, dtype=torch.float64)
    layer = _layer(fmt, ranks=4, seed=6)
    model = nn.Sequential(layer)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    control = comera.RankController(model, opt, lam=0.01)
    x = torch.randn(256, IN, dtype=torch.float64)
    y = teacher(x).detach()
    for _ in range(20):
        opt.zero_grad()
        control.loss(nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
        control.after_step()
    target = math.floor(model_size(model) * 0.6)
    control.start_late_stage(comera.LateStage(target, steps=20))
    for _ in range(20):
        opt.zero_grad()
        control.loss(nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
        control.after_step()
    assert model_size(model) <= target
    assert torch.isfinite(model(x)).all()


def test_from_eq_declares_a_layer_without_a_class():
    torch.manual_seed(7)
    layer = GatedLinear.from_eq("b i j, i a, a j k -> b k", bonds="a",
                                sizes={"i": 3, "j": 4, "k": 5}, ranks=2, dtype=torch.float64)
    with torch.no_grad():
        layer.gates[0].copy_(torch.tensor([0.7, 0.0]))  # the second slice pruned
    x = torch.randn(6, 12, dtype=torch.float64)
    a, b = layer.cores
    gate = layer.gates[0] * torch.tensor([1.0, 0.0], dtype=torch.float64)
    ref = torch.einsum("bij,ia,ajk->bk", x.reshape(6, 3, 4), a * gate, b) + layer.bias
    torch.testing.assert_close(layer(x), ref)
    assert layer.num_parameters() == 3 * 1 + 1 * 4 * 5 + 5
    model = nn.Sequential(layer)
    comera.truncate_(model)
    assert layer.layout.bond_sizes == (1,)
    torch.testing.assert_close(layer(x), ref)


# -- the ways users call a layer: autocast, torch.compile, threads (float32, as users train) ---
def _f32_layer(fmt: str) -> GatedLinear:
    torch.manual_seed(8)
    layer = GatedLinear(IN, OUT, format=fmt, ranks=3, d=3)
    with torch.no_grad():
        for g in layer.gates:
            g.uniform_(0.5, 1.5)
    return layer


def test_autocast_computes_in_bfloat16_like_nn_linear(fmt):
    layer = _f32_layer(fmt)
    x = torch.randn(5, IN)
    want = layer(x)
    with torch.autocast("cpu", torch.bfloat16):
        got = layer(x)
    assert got.dtype == torch.bfloat16
    assert all(c.dtype == torch.float32 for c in layer.cores)
    scale = float(want.abs().max())
    torch.testing.assert_close(got.float(), want, rtol=5e-2, atol=5e-2 * scale)


def compiled_matches_eager(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` under ``torch.compile(fullgraph=True)`` equals eager, forward and the
    parameters' gradients; returns the compiled output."""
    want = module(x)
    want.square().sum().backward()
    want_grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    got = torch.compile(module, backend="aot_eager", fullgraph=True)(x)
    got.square().sum().backward()
    torch.testing.assert_close(got, want)
    for p, grad in zip(module.parameters(), want_grads, strict=True):
        torch.testing.assert_close(p.grad, grad)
    return got


def test_torch_compile_fullgraph_matches_eager_and_the_dense_weight(fmt):
    layer = _f32_layer(fmt)
    x = torch.randn(5, IN)
    got = compiled_matches_eager(layer, x)
    torch.testing.assert_close(got, _dense_out(layer, x), rtol=1e-4, atol=1e-5)


def test_threads_calling_one_layer_get_the_serial_result(fmt):
    from concurrent.futures import ThreadPoolExecutor

    layer = _f32_layer(fmt)
    xs = [torch.randn(4 + k, IN) for k in range(8)]
    with torch.no_grad():
        want = [layer(x) for x in xs]
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(layer, xs))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


# -- embedding tables: every format that holds one (the registry says how) -------------------
TABLES = list(table_formats())
ROWS, DIM, PAD = 30, 12, 4  # 30 rows pad to the modes' product; row PAD is the padding row


@pytest.fixture(params=TABLES)
def table_fmt(request) -> str:
    return request.param


def _table(fmt: str, ranks=3, seed: int = 0, dtype=torch.float64) -> GatedEmbedding:
    torch.manual_seed(seed)
    table = gated_embedding(ROWS, DIM, fmt, ranks=ranks, padding_idx=PAD, d=2, dtype=dtype)
    with torch.no_grad():
        for g in table.gates:  # gates other than one, so folding them in is exercised
            g.uniform_(0.5, 1.5)
    return table


IDS = torch.tensor([[0, PAD, 29, 7, 7], [3, 29, 1, PAD, 12]])


def test_every_table_format_is_a_registered_format_with_a_table_class(table_fmt):
    held = table_format(table_fmt)
    assert held in format_names() and get_format(held).table_format == held
    table = _table(table_fmt)
    assert type(table) is embedding_class(held) and table.format.name == held
    assert set(TABLES) >= {"tt", "ttm"} and "einsum" not in TABLES


def test_table_lookup_equals_its_dense_rows(table_fmt):
    table = _table(table_fmt)
    rows = table(IDS)
    dense = table.to_dense()  # (ROWS, DIM), the padding row zero
    assert dense.shape == (ROWS, DIM) and not dense[PAD].any()
    ref = dense[IDS]
    torch.testing.assert_close(rows, ref, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(rows)
    params = [*table.cores, *table.gates]
    for a, b in zip(torch.autograd.grad(rows, params, g), torch.autograd.grad(ref, params, g),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    full = table.layout.dense(table.gated_cores())  # plain torch.einsum of the layout
    torch.testing.assert_close(dense[:PAD], full[:PAD], rtol=1e-10, atol=1e-12)


def test_table_gradcheck(table_fmt):
    table = _table(table_fmt, ranks=2)
    names = [name for name, _ in table.named_parameters()]
    values = [p.detach().clone().requires_grad_() for p in table.parameters()]

    def run(*values):
        return torch.func.functional_call(table, dict(zip(names, values, strict=True)), (IDS,))

    assert torch.autograd.gradcheck(run, tuple(values))


def test_table_from_a_trained_embedding_at_full_rank(table_fmt):
    held = table_format(table_fmt)
    torch.manual_seed(1)
    embedding = nn.Embedding(ROWS, DIM, padding_idx=PAD, dtype=torch.float64)
    table = embedding_class(held).from_embedding(embedding, 10_000, d=2, format=held)
    assert table.padding_idx == PAD
    if get_format(held).exact_decomposition:
        torch.testing.assert_close(table(IDS), embedding(IDS), rtol=1e-9, atol=1e-10)


def test_table_prunes_and_truncates_keeping_the_function(table_fmt):
    table = _table(table_fmt)
    model = nn.Sequential(table)
    before = table.num_parameters()
    with torch.no_grad():
        table.gates[0][-1] = 0.0
    assert table.num_parameters() < before
    expected = model(IDS).detach()
    torch.testing.assert_close(expected, table.to_dense()[IDS], rtol=1e-10, atol=1e-12)
    size = model_size(model)
    comera.truncate_(model)
    torch.testing.assert_close(model(IDS), expected, rtol=1e-10, atol=1e-12)
    assert model_size(model) == size
    assert table.layout.core_shapes == tuple(tuple(c.shape) for c in table.cores)


def test_convert_takes_embeddings_to_the_formats_table(table_fmt):
    torch.manual_seed(4)
    model = nn.Sequential(nn.Embedding(ROWS, DIM, dtype=torch.float64),
                          nn.Linear(DIM, 6, dtype=torch.float64))
    expected = model(IDS).detach()
    report = comera.convert_(model, comera.ConvertConfig(format=table_fmt, ranks=10_000, d=2,
                                                         embedding=True))
    held = table_format(table_fmt)
    assert type(model[0]) is embedding_class(held)
    assert [r.format for r in report.layers] == [held, table_fmt]
    if get_format(held).exact_decomposition and get_format(table_fmt).exact_decomposition:
        torch.testing.assert_close(model(IDS), expected, rtol=1e-8, atol=1e-9)


def _saved_table(fmt: str) -> nn.Sequential:
    """A table pruned, truncated (bonds smaller than a fresh table's) and of a tau other than
    the default: what loading must restore."""
    model = nn.Sequential(_table(fmt, seed=2))
    with torch.no_grad():
        model[0].gates[0][-1] = 0.0
    comera.truncate_(model)
    model[0].tau = 0.25
    return model


def _check_loaded(loaded: nn.Module, saved: nn.Module) -> None:
    assert type(loaded[0]) is type(saved[0])
    assert loaded[0].format.name == saved[0].format.name and loaded[0].tau == saved[0].tau
    assert loaded[0].bond_sizes == saved[0].bond_sizes
    assert loaded[0].padding_idx == PAD and not loaded(IDS)[IDS == PAD].any()
    assert torch.equal(loaded(IDS), saved(IDS))


def test_table_checkpoint_round_trip(table_fmt, tmp_path):
    """A table of every format round-trips through a checkpoint: into a fresh model (its
    table resized to the saved bonds) and into the unconverted model (its nn.Embedding
    replaced by the saved table), outputs identical."""
    model = _saved_table(table_fmt)
    path = tmp_path / "m.pt"
    comera.save_checkpoint(path, model)
    assert [r["kind"] for r in comera.read_checkpoint(path).layers.values()] == [
        "TTEmbedding" if isinstance(model[0], comera.TTEmbedding) else "GatedEmbedding"]
    fresh = nn.Sequential(_table(table_fmt, seed=3))
    assert fresh[0].bond_sizes != model[0].bond_sizes
    comera.load_checkpoint(path, fresh)
    _check_loaded(fresh, model)
    dense = nn.Sequential(nn.Embedding(ROWS, DIM, padding_idx=PAD, dtype=torch.float64))
    comera.load_checkpoint(path, dense)
    _check_loaded(dense, model)


def test_table_save_pretrained_round_trip(table_fmt, tmp_path):
    pytest.importorskip("safetensors")
    model = _saved_table(table_fmt)
    comera.save_pretrained(model, tmp_path)
    for target in (nn.Sequential(_table(table_fmt, seed=3)),
                   nn.Sequential(nn.Embedding(ROWS, DIM, padding_idx=PAD, dtype=torch.float64))):
        _check_loaded(comera.from_pretrained(tmp_path, target), model)


def test_a_table_checkpoint_refuses_a_model_of_another_table(table_fmt, tmp_path):
    """Checked before anything changes: other rows, another padding row, another format."""
    path = tmp_path / "m.pt"
    comera.save_checkpoint(path, _saved_table(table_fmt))
    other = next(f for f in TABLES if table_format(f) != table_format(table_fmt))
    for model, needle in (
            (nn.Sequential(nn.Embedding(ROWS + 1, DIM, padding_idx=PAD)), r"\(rows, dim\)"),
            (nn.Sequential(nn.Embedding(ROWS, DIM, padding_idx=PAD + 1)), "padding_idx"),
            (nn.Sequential(_table(other)), "the model has a|format")):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(comera.CheckpointError, match=needle):
            comera.load_checkpoint(path, model)
        assert model.state_dict().keys() == before.keys()
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_table_autocast_keeps_the_tables_dtype_and_compile_matches_eager(table_fmt):
    table = _table(table_fmt, dtype=torch.float32)
    with torch.autocast("cpu", torch.bfloat16):
        assert table(IDS).dtype == torch.float32  # as nn.Embedding: no low precision
    compiled_matches_eager(table, IDS)
