"""comera layers: TTLinear / TTMLinear / TTEmbedding against their dense reconstructions."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from torch import nn
from torch.func import functional_call

import comera
from comera import TTEmbedding, TTLinear, TTMLinear
from comera.formats.factorize import suggest_padded_size

F64 = torch.float64
LAYERS = (TTLinear, TTMLinear)


def _dense_out(layer, x):
    y = x @ layer.to_dense().T
    return y + layer.bias if layer.bias is not None else y


def _randomize_gates_(layer, lo=0.5, hi=1.5):
    """Gates away from 1 (and far above tau) so they are really exercised."""
    with torch.no_grad():
        for g in layer.gates:
            g.uniform_(lo, hi)
        if layer.bias is not None:
            layer.bias.normal_()


# (in_features, out_features, in_modes, out_modes) with d = 1, 2, 3 and odd modes
SHAPES = [
    (7, 5, (7,), (5,)),
    (15, 14, (3, 5), (7, 2)),
    (45, 21, (3, 5, 3), (1, 7, 3)),
]


def _rank_variants(cls, in_modes, out_modes):
    d = len(in_modes)
    n_bonds = 2 * d - 1 if cls is TTLinear else d - 1
    interior = [2 + (k % 3) for k in range(n_bonds)]
    return [3, interior, [1, *interior, 1]]


CASES = [
    pytest.param(cls, shape, kind, id=f"{cls.__name__}-d{len(shape[2])}-{kind}")
    for cls in LAYERS
    for shape in SHAPES
    for kind in ("int", "interior", "full")
]


@pytest.mark.parametrize(("cls", "shape", "kind"), CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_forward_equals_dense_reconstruction(cls, shape, kind, bias):
    torch.manual_seed(0)
    n_in, n_out, in_modes, out_modes = shape
    ranks = _rank_variants(cls, in_modes, out_modes)[("int", "interior", "full").index(kind)]
    layer = cls(n_in, n_out, in_modes, out_modes, ranks=ranks, bias=bias, dtype=F64)
    if kind != "int":
        expected_bonds = tuple(ranks) if kind == "full" else (1, *ranks, 1)
        assert layer.bonds == expected_bonds
    _randomize_gates_(layer)
    assert layer.to_dense().shape == (n_out, n_in)
    for x_shape in [(4, n_in), (2, 3, n_in), (1, n_in), (1, 1, n_in)]:
        x = torch.randn(*x_shape, dtype=F64)
        y = layer(x)
        assert y.shape == (*x_shape[:-1], n_out)
        torch.testing.assert_close(y, _dense_out(layer, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cls", LAYERS)
def test_one_dimensional_input_like_nn_linear(cls):
    torch.manual_seed(1)
    layer = cls(15, 14, (3, 5), (7, 2), ranks=4, dtype=F64)
    x = torch.randn(15, dtype=F64)
    torch.testing.assert_close(layer(x), _dense_out(layer, x))


@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize(("shape", "d"), [((15, 14, (3, 5), (7, 2)), 2),
                                          ((45, 21, (3, 5, 3), (1, 7, 3)), 3),
                                          ((12, 8, None, None), 3),
                                          ((7, 5, (7,), (5,)), 1)])
def test_from_linear_full_rank_reproduces_linear(cls, shape, d):
    torch.manual_seed(2)
    n_in, n_out, in_modes, out_modes = shape
    lin = nn.Linear(n_in, n_out, dtype=F64)
    layer = cls.from_linear(lin, ranks=10**6, in_modes=in_modes, out_modes=out_modes, d=d)
    assert isinstance(layer, cls)
    assert layer.cores[0].dtype == F64
    for x_shape in [(5, n_in), (2, 3, n_in), (1, n_in)]:
        x = torch.randn(*x_shape, dtype=F64)
        torch.testing.assert_close(layer(x), lin(x), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(layer.to_dense(), lin.weight, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(layer.bias, lin.bias)


@pytest.mark.parametrize("cls", LAYERS)
def test_from_linear_without_bias(cls):
    torch.manual_seed(3)
    lin = nn.Linear(15, 14, bias=False, dtype=F64)
    layer = cls.from_linear(lin, ranks=10**6, in_modes=(3, 5), out_modes=(7, 2))
    assert layer.bias is None
    x = torch.randn(4, 15, dtype=F64)
    torch.testing.assert_close(layer(x), lin(x), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize(("cls", "ranks", "bonds"), [
    (TTLinear, [1, 50, 50, 50, 1], (1, 3, 14, 2, 1)),
    (TTMLinear, [50], (1, 10, 1)),
])
def test_from_linear_explicit_ranks_above_the_exact_ones(cls, ranks, bonds):
    # explicit bonds larger than the TT-SVD can reach: the layer takes the exact ranks
    torch.manual_seed(15)
    lin = nn.Linear(15, 14, dtype=F64)
    layer = cls.from_linear(lin, ranks=ranks, in_modes=(3, 5), out_modes=(7, 2))
    assert layer.bonds == bonds
    assert [g.numel() for g in layer.gates] == list(bonds[1:-1])
    x = torch.randn(4, 15, dtype=F64)
    torch.testing.assert_close(layer(x), lin(x), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("cls", LAYERS)
def test_empty_batch(cls):
    layer = cls(15, 14, (3, 5), (7, 2), ranks=2)
    with torch.no_grad():
        layer.bias.normal_()
    assert layer(torch.randn(0, 15)).shape == (0, 14)
    y = layer(torch.randn(2, 0, 15))
    assert y.shape == (2, 0, 14)


# One side's modes given: the other side gets as many modes (regression tests).


@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize("kwargs", [
    {"in_features": 16, "out_features": 12, "in_modes": (4, 4)},
    {"in_features": 16, "out_features": 12, "out_modes": (3, 4)},
    {"in_features": 13, "out_features": 16, "in_modes": (1, 13), "d": 2},
    {"in_features": 16, "out_features": 13, "out_modes": (13, 1), "d": 2},
], ids=["in-length", "out-length", "in-prime", "out-prime"])
def test_one_sided_modes_follow_the_given_side(cls, kwargs):
    layer = cls(**kwargs, ranks=2)
    assert len(layer.in_modes) == len(layer.out_modes) == 2
    assert math.prod(layer.in_modes) == kwargs["in_features"]
    assert math.prod(layer.out_modes) == kwargs["out_features"]


def test_embedding_row_modes_follow_given_col_modes():
    layer = TTEmbedding(29, 12, col_modes=(3, 4), ranks=2)  # got: row_modes of length 3
    assert len(layer.row_modes) == 2 and math.prod(layer.row_modes) >= 29


# ------------------------------------------------------------------------------ TTEmbedding
EMB_SHAPES = [  # (num_embeddings, dim, row_modes, col_modes): d = 1..4, padded row counts
    (11, 5, (11,), (5,)),
    (13, 6, (3, 5), (2, 3)),
    (29, 12, (2, 3, 5), (2, 3, 2)),
    (30, 8, (2, 2, 2, 4), (2, 1, 2, 2)),
]


@pytest.mark.parametrize("shape", EMB_SHAPES, ids=lambda s: f"d{len(s[2])}")
@pytest.mark.parametrize("padding_idx", [None, 3, -1])
@pytest.mark.parametrize("merge_pairs", [True, False])
def test_from_embedding_full_rank_reproduces_embedding(shape, padding_idx, merge_pairs):
    torch.manual_seed(4)
    num, dim, row_modes, col_modes = shape
    emb = nn.Embedding(num, dim, padding_idx=padding_idx, dtype=F64)
    # from_embedding takes no merge_pairs: set it before the first lookup (nothing compiled yet)
    layer = TTEmbedding.from_embedding(emb, ranks=10**6, row_modes=row_modes,
                                       col_modes=col_modes)
    layer.merge_pairs = merge_pairs
    assert layer.padding_idx == emb.padding_idx
    ids = torch.randint(0, num, (3, 7))
    ids[0, 0], ids[1, 2], ids[2, 6] = 0, num - 1, 0  # repeats and both ends
    if emb.padding_idx is not None:
        ids[1, 1] = emb.padding_idx
    out = layer(ids)
    assert out.shape == (3, 7, dim)
    torch.testing.assert_close(out, emb(ids), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(layer.to_dense(), emb.weight, rtol=1e-9, atol=1e-10)
    one = layer(torch.tensor([num - 1]))
    torch.testing.assert_close(one, emb.weight[num - 1 :].detach(), rtol=1e-9, atol=1e-10)
    if emb.padding_idx is not None:
        assert torch.equal(out[1, 1], torch.zeros(dim, dtype=F64))


@pytest.mark.parametrize("merge_pairs", [True, False])
def test_embedding_padding_rows_get_zero_gradient(merge_pairs):
    torch.manual_seed(5)
    layer = TTEmbedding(29, 12, (2, 3, 5), (2, 3, 2), ranks=4, padding_idx=7,
                        merge_pairs=merge_pairs, dtype=F64)
    _randomize_gates_(layer)
    out = layer(torch.tensor([[7, 7], [7, 7]]))
    assert torch.equal(out, torch.zeros_like(out))
    (out * torch.randn_like(out)).sum().backward()
    for p in [*layer.cores, *layer.gates]:
        assert p.grad is not None
        assert torch.count_nonzero(p.grad) == 0
    # mixed ids: the padding positions add nothing to the gradient of the others
    layer.zero_grad(set_to_none=True)
    weights = torch.randn(4, 12, dtype=F64)
    (layer(torch.tensor([1, 7, 28, 7])) * weights).sum().backward()
    mixed = [p.grad.clone() for p in layer.cores]
    layer.zero_grad(set_to_none=True)
    (layer(torch.tensor([1, 28])) * weights[[0, 2]]).sum().backward()
    for a, p in zip(mixed, layer.cores, strict=True):
        torch.testing.assert_close(a, p.grad)


@pytest.mark.parametrize("bad", [-1, 29])
def test_embedding_out_of_range_ids_raise_lookup_error(bad):
    layer = TTEmbedding(29, 12, (2, 3, 5), (2, 3, 2), ranks=4)
    with pytest.raises(comera.LookupIndexError, match=str(bad)) as info:
        layer(torch.tensor([0, bad, 3]))
    assert isinstance(info.value, IndexError)
    assert "[0, 29)" in str(info.value)


def test_embedding_float_ids_raise_config_error():
    layer = TTEmbedding(29, 12, (2, 3, 5), (2, 3, 2), ranks=4)
    with pytest.raises(comera.ConfigError, match="integer ids"):
        layer(torch.tensor([0.0, 1.0]))


def test_embedding_matches_dense_reconstruction_and_empty_batch():
    torch.manual_seed(6)
    layer = TTEmbedding(29, 12, (2, 3, 5), (2, 3, 2), ranks=[3, 2], dtype=F64)
    _randomize_gates_(layer)
    ids = torch.tensor([[0, 28, 5], [5, 5, 17]])
    torch.testing.assert_close(layer(ids), layer.to_dense()[ids])
    assert layer(torch.zeros(0, 3, dtype=torch.long)).shape == (0, 3, 12)


# ------------------------------------------------------------------------------ auto modes
def test_auto_modes_multiply_to_features():
    layer = TTLinear(768, 3072, ranks=4)
    assert math.prod(layer.in_modes) == 768
    assert math.prod(layer.out_modes) == 3072
    assert len(layer.in_modes) == len(layer.out_modes) == 3
    assert layer.in_modes == (8, 8, 12) and layer.out_modes == (12, 16, 16)
    ttm = TTMLinear(768, 3072, ranks=4)
    assert math.prod(ttm.in_modes) == 768 and math.prod(ttm.out_modes) == 3072


@pytest.mark.parametrize("cls", LAYERS)
def test_prime_in_features_raises_factorization_error_with_padding_hint(cls):
    with pytest.raises(comera.FactorizationError) as info:
        cls(769, 768)
    message = str(info.value)
    assert "769" in message and "prime" in message
    padded = suggest_padded_size(769, 3)
    assert padded > 769
    assert f"pad the dimension to {padded}" in message


# ------------------------------------------------------------------------------ gradients
def _gradcheck_layer(layer, x):
    names = [n for n, _ in layer.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for _, p in layer.named_parameters()]

    def fn(x, *ps):
        return functional_call(layer, dict(zip(names, ps, strict=True)), (x,))

    assert torch.autograd.gradcheck(fn, (x, *params), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize(("shape", "ranks"), [((6, 4, (2, 3), (2, 2)), 2),
                                              ((8, 6, (2, 2, 2), (1, 2, 3)), [2, 3, 2, 3, 2])])
def test_gradcheck_cores_gates_and_input(cls, shape, ranks):
    torch.manual_seed(7)
    n_in, n_out, in_modes, out_modes = shape
    if cls is TTMLinear and isinstance(ranks, list):
        ranks = [2, 3]
    layer = cls(n_in, n_out, in_modes, out_modes, ranks=ranks, dtype=F64)
    _randomize_gates_(layer)
    x = torch.randn(3, n_in, dtype=F64, requires_grad=True)
    _gradcheck_layer(layer, x)


@pytest.mark.parametrize("merge_pairs", [True, False])
def test_gradcheck_embedding_cores(merge_pairs):
    torch.manual_seed(8)
    layer = TTEmbedding(12, 6, (2, 2, 3), (1, 2, 3), ranks=2, padding_idx=4,
                        merge_pairs=merge_pairs, dtype=F64)
    _randomize_gates_(layer)
    ids = torch.tensor([[0, 4, 11], [3, 3, 7]])
    names = [n for n, _ in layer.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for _, p in layer.named_parameters()]

    def fn(*ps):
        return functional_call(layer, dict(zip(names, ps, strict=True)), (ids,))

    assert torch.autograd.gradcheck(fn, tuple(params), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("cls", [TTLinear, TTMLinear, TTEmbedding])
def test_gate_below_tau_is_exactly_zero_and_gets_no_gradient(cls):
    torch.manual_seed(9)
    if cls is TTEmbedding:
        layer = cls(12, 6, (2, 2, 3), (1, 2, 3), ranks=3, tau=0.01, dtype=F64)
        x = torch.tensor([[0, 5, 11], [3, 3, 7]])
    else:
        layer = cls(8, 6, (2, 2, 2), (1, 2, 3), ranks=3, tau=0.01, dtype=F64)
        x = torch.randn(5, 8, dtype=F64)
    _randomize_gates_(layer)
    with torch.no_grad():
        layer.gates[0][1] = 0.0
    exact_zero = layer(x).detach().clone()
    with torch.no_grad():
        layer.gates[0][1] = 0.005
    below = layer(x)
    assert torch.equal(below, exact_zero)
    assert layer.ranks[1] == layer.bonds[1] - 1
    (below * torch.randn_like(below)).sum().backward()
    g0 = layer.gates[0].grad
    assert g0[1].item() == 0.0
    keep = torch.ones_like(g0, dtype=torch.bool)
    keep[1] = False
    assert bool((g0[keep] != 0).all())
    for gate in layer.gates[1:]:
        assert bool((gate.grad != 0).all())
    # a gate exactly at tau is pruned too (|d| <= tau counts as zero)
    with torch.no_grad():
        layer.gates[0][1] = 0.01
    assert torch.equal(layer(x).detach(), exact_zero)


# ------------------------------------------------------------------------------ initialisation
def test_initial_dense_weight_variance():
    torch.manual_seed(10)
    layer = TTLinear(768, 3072, ranks=30)
    with torch.no_grad():
        var = layer.to_dense().var().item()
    target = 1.0 / (768 + 3072)
    assert target / 2 <= var <= target * 2
    assert all(bool((g == 1).all()) for g in layer.gates)
    assert torch.count_nonzero(layer.bias) == 0


# ------------------------------------------------------------------------------ serialisation
def _layer_and_input(cls):
    if cls is TTEmbedding:
        layer = cls(29, 12, (2, 3, 5), (2, 3, 2), ranks=3, padding_idx=2)
        return layer, torch.tensor([[0, 2, 28], [5, 5, 9]])
    layer = cls(15, 14, (3, 5), (7, 2), ranks=3)
    return layer, torch.randn(4, 15)


@pytest.mark.parametrize("cls", [TTLinear, TTMLinear, TTEmbedding])
def test_state_dict_round_trip(cls):
    torch.manual_seed(11)
    layer, x = _layer_and_input(cls)
    _randomize_gates_(layer)
    y = layer(x)
    torch.manual_seed(12)
    fresh, _ = _layer_and_input(cls)
    assert not torch.equal(fresh(x), y)
    fresh.load_state_dict(layer.state_dict())
    torch.testing.assert_close(fresh(x), y)


@pytest.mark.parametrize("cls", [TTLinear, TTMLinear, TTEmbedding])
def test_to_float64_after_a_float32_forward(cls):
    torch.manual_seed(13)
    layer, x = _layer_and_input(cls)
    _randomize_gates_(layer)
    y32 = layer(x)
    assert y32.dtype == torch.float32
    layer = layer.to(F64)
    assert all(p.dtype == F64 for p in layer.parameters())
    x64 = x.to(F64) if x.is_floating_point() else x
    y64 = layer(x64)
    assert y64.dtype == F64
    torch.testing.assert_close(y64.float(), y32, rtol=1e-4, atol=1e-5)
    if cls is TTEmbedding:
        torch.testing.assert_close(y64, layer.to_dense()[x])
    else:
        torch.testing.assert_close(y64, _dense_out(layer, x64))


@pytest.mark.parametrize("cls", [TTLinear, TTMLinear, TTEmbedding])
def test_deepcopy_and_pickle_after_forward(cls):
    torch.manual_seed(14)
    layer, x = _layer_and_input(cls)
    _randomize_gates_(layer)
    y = layer(x)  # compiled plan exists now
    copied = copy.deepcopy(layer)
    assert torch.equal(copied(x), y)
    unpickled = pickle.loads(pickle.dumps(layer))
    assert torch.equal(unpickled(x), y)
    with torch.no_grad():  # the copies own their parameters
        copied.cores[0].zero_()
    assert torch.equal(layer(x), y)


def test_compile_options_reach_the_compiled_plan():
    layer = TTLinear(16, 12, (4, 4), (3, 4), ranks=3, dtype=torch.float64)
    x = torch.randn(5, 16, dtype=torch.float64)
    expected = layer(x)
    layer.compile_options = {"optimize": "flops", "pool_buffers": False}
    torch.testing.assert_close(layer(x), expected)
    assert layer.compiled().options.optimize == "flops"
    assert not layer.compiled().options.pool_buffers


@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize("pool", [True, False])
def test_bias_is_added_into_the_result_with_no_second_output_buffer(cls, pool):
    """The bias goes into the contraction's own result (as nn.Linear folds it into addmm): the
    forward allocates one output-sized tensor, not two, and the values and every gradient are
    bit-identical to ``contraction + bias``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    layer = cls(64, 256, ranks=4)
    layer.compile_options = {"pool_buffers": pool}
    with torch.no_grad():
        layer.bias.uniform_(-1, 1)
    x = torch.randn(300, 64, requires_grad=True)
    out_bytes = 300 * 256 * 4

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.full = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            inputs = {t.untyped_storage().data_ptr() for t in
                      torch.utils._pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            pooled = func is torch.ops.aten.set_.source_Storage_storage_offset
            if (isinstance(out, torch.Tensor) and not pooled
                    and out.untyped_storage().data_ptr() not in inputs
                    and out.untyped_storage().nbytes() >= out_bytes):
                self.full += 1  # a new output-sized storage (not in place, not a pooled one)
            return out

    layer(x)  # plan and pool once
    seen = Allocations()
    with seen:
        y = layer(x)
    assert seen.full == (0 if pool else 1)  # pooled: the reused result; else: the result only
    xm = x.reshape(300, *layer.in_modes)
    want = (layer.compiled()(xm, *layer.gated_cores()).reshape(300, 256) + layer.bias)
    assert torch.equal(y, want)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, layer.bias, *layer.cores], dy)
    ref = torch.autograd.grad(want, [x, layer.bias, *layer.cores], dy)
    for g, r in zip(got, ref, strict=True):
        assert torch.equal(g, r)


def test_bias_under_vmap_over_stacked_parameters():
    """Model ensembling (torch.func.stack_module_state + vmap): each model's own bias is added,
    out of place, to its own result."""
    torch.manual_seed(0)
    models = [TTLinear(16, 24, ranks=3) for _ in range(3)]
    for m in models:
        with torch.no_grad():
            m.bias.uniform_(-1, 1)
    params, buffers = torch.func.stack_module_state(models)
    x = torch.randn(5, 16)

    def call(p, b, x):
        return functional_call(models[0], (p, b), (x,))

    got = torch.func.vmap(call, in_dims=(0, 0, None))(params, buffers, x)
    for k, m in enumerate(models):
        torch.testing.assert_close(got[k], m(x))
