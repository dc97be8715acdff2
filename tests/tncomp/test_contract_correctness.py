"""Every plan tncomp builds computes what torch.einsum computes (float64, fresh random inputs).

Layers (TT, TT-matrix, TT embedding) and einsum networks are compiled with each optimize preset
and run at batch sizes on both sides of every regime breakpoint, so every regime's tree runs.
"""

from __future__ import annotations

import math

import pytest
import torch

import tncomp
from tests.helpers.tn import F64, batches_around, bind, compile_net, einsum_eq, operands, reference
from tncomp import Dim

PRESETS = ("auto", "search", "flops")
TOL = {"rtol": 1e-10, "atol": 1e-10}
B_LIMIT = 600  # largest batch the layer tests run at

# Odd mode sizes, a mode of size 1 at d=4, and a rank-1 bond in every interior-rank list.
IN_MODES = {1: (3,), 2: (3, 5), 3: (3, 5, 2), 4: (3, 5, 2, 2)}
OUT_MODES = {1: (2,), 2: (2, 7), 3: (2, 7, 3), 4: (2, 7, 1, 3)}


def _interior(n_bonds: int) -> list[int]:
    return [(2, 3, 1)[k % 3] for k in range(n_bonds)]


def _rank_forms(n_cores: int) -> dict[str, object]:
    interior = _interior(n_cores - 1)
    return {"int3": 3, "int1": 1, "interior": interior, "full": [1, *interior, 1]}


def _layer(kind: str, d: int, form: str):
    n_cores = 2 * d if kind == "tt" else d
    ranks = _rank_forms(n_cores)[form]
    build = tncomp.tt_linear if kind == "tt" else tncomp.ttm_linear
    return build(IN_MODES[d], OUT_MODES[d], ranks)


def _check_at_batches(net, f, batches, seed=0):
    trees = set()
    for b in batches:
        ts = operands(net, b, seed=seed + b)
        y = f(*ts)
        ref = reference(net, ts)
        assert y.shape == ref.shape, (b, y.shape, ref.shape)
        assert y.dtype == F64
        torch.testing.assert_close(y, ref, **TOL, msg=lambda m, b=b: f"B={b}: {m}")
        trees.add(f.plan_for(bind(net, b), (False,) * len(net.operands), F64).tree)
    return trees


def _layer_params():
    for kind in ("tt", "ttm"):
        for d in (1, 2, 3, 4):
            for form in ("int3", "int1", "interior", "full"):
                # The d=4 TT layer (9 operands) takes seconds per regime table: two forms
                # run by default, the others with -m slow.
                slow = kind == "tt" and d == 4 and form in ("int1", "interior")
                marks = [pytest.mark.slow] if slow else []
                yield pytest.param(kind, d, form, marks=marks, id=f"{kind}-d{d}-{form}")


@pytest.mark.parametrize(("kind", "d", "form"), list(_layer_params()))
def test_layers_match_einsum_across_regimes(kind, d, form):
    net = _layer(kind, d, form)
    n = len(net.operands)
    auto = compile_net(net)
    table = auto.regimes((False,) * n, itemsize=8)
    batches = batches_around(table.breakpoints, B_LIMIT, extra=(1, 2, 7, 64))
    used = _check_at_batches(net, auto, batches)
    # "auto" runs exactly the regime table's tree at each batch size.
    for b in batches:
        assert auto.plan_for(bind(net, b), (False,) * n, F64).tree == table.tree_for(b)
    crossed = [bp for bp in table.breakpoints if bp <= B_LIMIT]
    if crossed:
        assert len(used) >= 2, "batches around a breakpoint should run more than one tree"
    for preset in ("search", "flops"):
        _check_at_batches(net, compile_net(net, optimize=preset), batches)


@pytest.mark.parametrize("kind", ["tt", "ttm"])
def test_layer_shapes_and_bond_lists(kind):
    net = _layer(kind, 2, "full")
    names = [t.name for t in net.operands]
    assert names[0] == "x"
    x_shape = net.shape(net.operands[0])
    assert isinstance(x_shape[0], Dim) and x_shape[1:] == IN_MODES[2]
    cores = [net.shape(t) for t in net.operands[1:]]
    bonds = [1, *_interior(len(cores) - 1), 1]
    assert [c[0] for c in cores] == bonds[:-1]
    assert [c[-1] for c in cores] == bonds[1:]
    if kind == "tt":
        assert [c[1] for c in cores] == [*IN_MODES[2], *OUT_MODES[2]]
    else:
        assert [c[1:3] for c in cores] == list(zip(IN_MODES[2], OUT_MODES[2], strict=True))


def test_int_rank_is_clipped_to_reachable_bonds():
    net = tncomp.tt_linear([12, 8, 8], [12, 16, 16], 30)
    bonds = [net.shape(t)[0] for t in net.operands[1:]] + [1]
    assert bonds == [1, 12, 30, 30, 30, 16, 1]
    assert tncomp.extend.resolve_ranks(5, [2, 3]) == (1, 2, 1)


@pytest.mark.parametrize("d", [1, 2, 3])
def test_ttm_embedding_matches_einsum(d):
    net = tncomp.ttm_embedding((3, 4, 2)[:d], (2, 5, 3)[:d], [1, *(2, 3)[: d - 1], 1])
    assert net.output.indices[0] == "b"
    for preset in PRESETS:
        f = compile_net(net, optimize=preset)
        _check_at_batches(net, f, (1, 3, 9, 40))


@pytest.mark.parametrize("d", [1, 2, 3])
def test_ttm_embedding_gathers_rows_of_the_dense_table(d):
    row_modes, col_modes = (3, 4, 2)[:d], (2, 5, 3)[:d]
    net = tncomp.ttm_embedding(row_modes, col_modes, 2)
    gen = torch.Generator().manual_seed(d)
    cores = [torch.randn(net.shape(t)[1], m, n, net.shape(t)[3], generator=gen, dtype=F64)
             for t, m, n in zip(net.operands, row_modes, col_modes, strict=True)]
    # Dense table W[(i1..id), (j1..jd)] = prod_k cores[k][:, i_k, j_k, :].
    letters = "abcdefgh"
    terms = [f"{letters[k]}{'mno'[k]}{'pqr'[k]}{letters[k + 1]}" for k in range(d)]
    dense_eq = ",".join(terms) + "->" + "mno"[:d] + "pqr"[:d]
    table = torch.einsum(dense_eq, *cores).reshape(math.prod(row_modes), math.prod(col_modes))
    n_rows = math.prod(row_modes)
    rows = torch.tensor([0, n_rows - 1, n_rows // 2, n_rows - 1, 1])
    multi = torch.stack(torch.unravel_index(rows, row_modes), dim=1)  # (B, d)
    slices = [c.index_select(1, multi[:, k]).movedim(1, 0) for k, c in enumerate(cores)]
    y = compile_net(net)(*slices)
    torch.testing.assert_close(y.reshape(len(rows), -1), table[rows], **TOL)


EQ_CASES = {
    "matrix_chain": ("ij,jk,kl,lm->im", [(3, 4), (4, 5), (5, 2), (2, 6)]),
    "hyperedge_batch": ("bij,bjk->bik", [("B", 3, 4), ("B", 4, 2)]),
    "hyper_three": ("bi,bj,bk->bijk", [("B", 2), ("B", 3), ("B", 2)]),
    "hyper_summed": ("bi,bj,bk->ijk", [(5, 2), (5, 3), (5, 2)]),
    "outer": ("i,j->ij", [(3,), (4,)]),
    "outer_three": ("i,j,k->kji", [(3,), (4,), (2,)]),
    "full_reduction": ("ij,ij->", [(3, 4), (3, 4)]),
    "trace_of_product": ("ab,bc,ca->", [(2, 3), (3, 4), (4, 2)]),
    "transpose": ("ijk->kij", [(2, 3, 4)]),
    "identity": ("ij->ij", [(2, 3)]),
    "single_sum": ("ij->", [(3, 4)]),
    "single_partial_sum": ("ijk->ki", [(3, 4, 5)]),
    "summed_within_operand": ("ijk,kl->il", [(3, 4, 5), (5, 2)]),
    "both_sides_summed": ("ijk,klm->im", [(3, 4, 5), (5, 2, 3)]),
    "implicit_output": ("ij,jk", [(3, 4), (4, 5)]),
    "unit_sizes": ("ab,bc,cd->ad", [(1, 3), (3, 1), (1, 1)]),
    "scalar_operand": (",i->i", [(), (4,)]),
    "symbolic_two_dims": ("bi,ij,cj->bc", [("B", 3), (3, 4), ("C", 4)]),
    "dot": ("i,i->", [(7,), (7,)]),
    "batched_vec": ("bi,i->b", [("B", 3), (3,)]),
    # '...' and size-1 broadcasting, read as torch.einsum reads them (tncomp/compiler/einsum.py)
    "ellipsis_batch": ("...i,ij->...j", [("B", 2, 3), (3, 4)]),
    "ellipsis_implicit": ("...ij,...jk", [("B", 1, 3, 4), (5, 4, 2)]),
    "broadcast_size_one": ("bi,bi->bi", [("B", 3), (1, 3)]),
    "broadcast_summed": ("bij,bj->i", [("B", 2, 3), (1, 3)]),
}


def _eq_operands(net, b, seed):
    return operands(net, b, seed=seed)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("case", sorted(EQ_CASES))
def test_from_eq_matches_einsum(case, preset):
    eq, shapes = EQ_CASES[case]
    net = tncomp.from_eq(eq, *shapes)
    f = compile_net(net, optimize=preset)
    batches = [1, 2, 5, 33] if net.dims else [1]
    if preset == "auto" and len(net.dims) == 1:
        table = f.regimes((False,) * len(net.operands), itemsize=8)
        batches = batches_around(table.breakpoints, 300, extra=batches)
    for b in batches:
        ts = _eq_operands(net, b, seed=b)
        y = f(*ts)
        torch.testing.assert_close(y, torch.einsum(eq, *ts), **TOL)


def test_from_eq_with_dims_object_and_names():
    net = tncomp.from_eq("bi,ij->bj", (Dim("N", min=2, max=50), 3), (3, 4), names=("x", "w"))
    assert [t.name for t in net.operands] == ["x", "w"]
    f = compile_net(net)
    table = f.regimes((False, False), itemsize=8)
    assert table.regimes[0].lo == 2 and table.regimes[-1].hi == 50
    for b in (2, 17, 50):
        ts = operands(net, b, seed=b)
        torch.testing.assert_close(f(*ts), ts[0] @ ts[1], **TOL)


def test_contract_matches_einsum_and_reuses_compilation():
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(4, 5, generator=gen, dtype=F64)
    b = torch.randn(5, 6, generator=gen, dtype=F64)
    c = torch.randn(6, 3, generator=gen, dtype=F64)
    for eq in ("ij,jk,kl->il", "ij,jk,kl->li", "ij,jk,kl->"):
        torch.testing.assert_close(tncomp.contract(eq, a, b, c), torch.einsum(eq, a, b, c), **TOL)
    a2 = torch.randn(4, 5, generator=gen, dtype=F64)
    torch.testing.assert_close(tncomp.contract("ij,jk,kl->il", a2, b, c),
                               torch.einsum("ij,jk,kl->il", a2, b, c), **TOL)
    torch.testing.assert_close(tncomp.contract("ij,jk->ik", a, b, optimize="flops"), a @ b, **TOL)


def test_float32_matches_einsum():
    net = tncomp.tt_linear([3, 5], [2, 7], 3)
    ts = operands(net, 6, seed=1, dtype=torch.float32)
    y = compile_net(net)(*ts)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, reference(net, ts), rtol=1e-5, atol=1e-5)


def test_non_contiguous_and_broadcast_inputs():
    net = tncomp.from_eq("ij,jk,kl->il", (3, 4), (4, 5), (5, 2))
    f = compile_net(net)
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(4, 3, generator=gen, dtype=F64).t()  # transposed view
    b = torch.randn(4, 10, generator=gen, dtype=F64)[:, ::2]  # strided view
    c = torch.randn(1, 2, generator=gen, dtype=F64).expand(5, 2)  # zero stride
    assert not a.is_contiguous() and not b.is_contiguous() and not c.is_contiguous()
    torch.testing.assert_close(f(a, b, c), a @ b @ c, **TOL)
    # The same shapes, contiguous: a cached plan with reshapes left out still handles both.
    a2, b2, c2 = a.contiguous(), b.contiguous(), c.contiguous()
    torch.testing.assert_close(f(a2, b2, c2), a @ b @ c, **TOL)
    torch.testing.assert_close(f(a, b, c), a @ b @ c, **TOL)


def test_tt_with_noncontiguous_input():
    net = tncomp.tt_linear([3, 5], [2, 7], 2)
    f = compile_net(net)
    ts = operands(net, 6, seed=2)
    x_t = ts[0].permute(2, 1, 0).contiguous().permute(2, 1, 0)  # same values, other strides
    assert not x_t.is_contiguous()
    torch.testing.assert_close(f(x_t, *ts[1:]), reference(net, ts), **TOL)


def test_outputs_of_consecutive_calls_stay_independent():
    """Large results may come from reused buffers: earlier outputs must never change."""
    net = tncomp.tt_linear([12, 8, 8], [8, 8, 12], 8)
    f = compile_net(net)
    first = operands(net, 64, seed=1)
    y1 = f(*first)
    keep = y1.clone()
    outs = [f(*operands(net, 64, seed=s)) for s in (2, 3, 4)]
    assert torch.equal(y1, keep)
    torch.testing.assert_close(y1, reference(net, first), **TOL)
    assert len({o.data_ptr() for o in (y1, *outs)}) == 4
    y1.mul_(0)  # writing into an output must not affect later calls
    torch.testing.assert_close(f(*first), keep, **TOL)
    del y1, outs
    torch.testing.assert_close(f(*first), keep, **TOL)


def test_einsum_eq_helper_round_trip():
    net = tncomp.from_eq("bij,bjk->bik", ("B", 3, 4), ("B", 4, 2))
    assert einsum_eq(net) == "abc,acd->abd"


@pytest.mark.parametrize(
    "options",
    [{"autotune": True}, {"cuda_graphs": True}, {"pool_buffers": False},
     {"autotune": True, "optimize": "search"}],
    ids=["autotune", "cuda_graphs_on_cpu", "no_pool", "autotune_search"],
)
def test_compile_options_keep_results_exact(options, tmp_path):
    net = tncomp.tt_linear([12, 8, 8], [8, 8, 12], 8)
    f = tncomp.compile(net, disk_cache=tmp_path, **options)
    for b in (1, 64):
        ts = operands(net, b, seed=b, requires_grad=True)
        y = f(*ts)
        refs = [t.detach().clone().requires_grad_() for t in ts]
        ry = reference(net, refs)
        torch.testing.assert_close(y, ry, **TOL)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(b), dtype=F64)
        for g, r in zip(torch.autograd.grad(y, ts, dy), torch.autograd.grad(ry, refs, dy),
                        strict=True):
            torch.testing.assert_close(g, r, **TOL)
