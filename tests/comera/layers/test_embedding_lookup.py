"""TTEmbedding's lookup merges only the core pairs a batch uses when that is cheaper: the rows
of those pairs equal the whole merged table's, their gradients equal autograd's through the
dense reconstruction, and a sparse batch costs far fewer multiply-adds than merging the table."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from comera import TTEmbedding
from comera.layers import embedding
from comera.layers.embedding import _merge_pair_rows

F64 = torch.float64


@pytest.mark.parametrize(("first", "second"), [
    ((1, 7, 2, 3), (3, 5, 2, 4)),  # second's slices larger: grouped by the second digit
    ((4, 7, 3, 3), (3, 5, 2, 1)),  # first's slices larger: grouped by the first digit
])
def test_merged_pair_rows_equal_the_whole_merged_table(first, second):
    torch.manual_seed(0)
    a_core = torch.randn(*first, dtype=F64, requires_grad=True)
    b_core = torch.randn(*second, dtype=F64, requires_grad=True)
    r0, m1, n1, _ = first
    _, m2, n2, r2 = second
    whole = torch.einsum("pimq,qjnr->ijpmnr", a_core, b_core).reshape(m1 * m2, r0, n1 * n2, r2)
    pairs = torch.tensor([0, 3, 4, 9, 10, 11, 17, 34])  # repeated digits on both sides
    a, b = pairs // m2, pairs % m2
    rows = _merge_pair_rows(a_core, b_core, a, b)
    torch.testing.assert_close(rows, whole[pairs], rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, y: _merge_pair_rows(x, y, a, b), (a_core, b_core))


SPARSE_SHAPES = [  # (row_modes, col_modes): the first pair's rows number 2,000
    ((40, 50, 3), (2, 2, 2)),  # pair (0, 1) grouped by its second digit
    ((3, 2, 40, 50), (2, 2, 2, 1)),  # pair (2, 3): the first core's slices are larger
]


def _sparse_layer(row_modes=SPARSE_SHAPES[0][0], col_modes=SPARSE_SHAPES[0][1]) -> TTEmbedding:
    """A table whose large pair of cores a handful of ids barely touches."""
    torch.manual_seed(1)
    layer = TTEmbedding(6000, 8, row_modes, col_modes, ranks=4, dtype=F64)
    with torch.no_grad():
        for g in layer.gates:
            g.uniform_(0.5, 1.5)
    return layer


@pytest.mark.parametrize("shape", SPARSE_SHAPES, ids=["d3", "d4"])
@pytest.mark.parametrize(("n_ids", "alone"), [(12, True), (30000, False)])  # 30,000: every pair
def test_lookup_and_gradients_equal_the_dense_reconstruction(shape, n_ids, alone, monkeypatch):
    layer = _sparse_layer(*shape)
    ids = torch.randint(0, 6000, (n_ids,), generator=torch.Generator().manual_seed(2))
    ids[:3] = ids[3]  # repeats
    weights = torch.randn(n_ids, 8, dtype=F64)
    merged_alone = []  # which pairs were merged for their used rows only (a spy, the real call)

    def spy(first, second, a, b):
        merged_alone.append(50 in (first.shape[1], second.shape[1]))
        return _merge_pair_rows(first, second, a, b)  # the real function, imported above

    monkeypatch.setattr(embedding, "_merge_pair_rows", spy)
    got = layer(ids)
    assert any(merged_alone) is alone  # the 40 x 50 pair: alone for few ids, whole for all
    grads = torch.autograd.grad((got * weights).sum(), list(layer.parameters()))
    dense = layer.to_dense()
    want = dense[ids]
    expected = torch.autograd.grad((want * weights).sum(), list(layer.parameters()))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_a_sparse_batch_does_not_merge_the_whole_table():
    layer = _sparse_layer()
    ids = torch.tensor([5, 17, 17, 2048, 5999])
    with FlopCounterMode(display=False) as counter:
        layer(ids).sum().backward()
    # merging cores 0 and 1 whole: 40 * 50 rows of (1*2) x 4 x (2*4) multiply-adds, forward
    # and two backward products
    whole_merge = 3 * 2 * (40 * 50) * (1 * 2) * 4 * (2 * 4)
    assert counter.get_total_flops() < whole_merge / 10


def test_int32_ids_look_up_the_same_rows_as_int64():
    """nn.Embedding takes int32 ids; the sparse merge's slot arithmetic once kept their dtype
    and failed on them."""
    layer = _sparse_layer()
    ids = torch.tensor([5, 17, 17, 2048, 5999])
    assert torch.equal(layer(ids.int()), layer(ids))


def _lookup_grads(emb: TTEmbedding, ids: torch.Tensor, create_graph: bool = False):
    out = emb(ids)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return out, torch.autograd.grad(out, list(emb.parameters()), dy, create_graph=create_graph)


@pytest.mark.parametrize("pool", [True, False])
def test_the_backward_gathers_the_slices_again_and_holds_only_the_tables(pool, monkeypatch):
    """Between forward and backward the lookup holds its tables and digits, not the gathered
    slices; the backward gathers them again, so values and gradients are bit-identical."""
    import contextlib

    from benchmarks.lib.memory import held_bytes

    torch.manual_seed(0)
    emb = TTEmbedding(30522, 768, row_modes=(16, 20, 10, 10), col_modes=(4, 4, 8, 6), ranks=32)
    emb.compile_options = {"pool_buffers": pool}
    ids = torch.randint(0, 30522, (32, 128))  # the slices over 4x each table: regathered
    emb(ids)  # plan once
    out, grads = _lookup_grads(emb, ids)
    held = held_bytes(lambda: emb(ids))
    monkeypatch.setattr(embedding, "_regathered_in_backward",
                        lambda gathers: contextlib.nullcontext())
    want_out, want_grads = _lookup_grads(emb, ids)
    held_with_slices = held_bytes(lambda: emb(ids))
    assert torch.equal(out, want_out)
    for g, w in zip(grads, want_grads, strict=True):
        assert torch.equal(g, w)
    n_unique = int(torch.unique(ids).numel())
    slices = n_unique * (1 * 4 * 4 * 32 + 32 * 8 * 6 * 1) * 4  # per id: both pairs' slices
    tables = (16 * 20 * 1 * 4 * 4 * 32 + 10 * 10 * 32 * 8 * 6 * 1) * 4  # the merged pairs
    assert held_with_slices - held >= slices - tables > 0


def test_with_an_outer_saved_tensor_hook_the_slices_are_saved_as_usual():
    """Inside save_on_cpu / checkpointing / a byte count, the enclosing hook sees every saved
    tensor (an inner hook would take its place), and the gradients are unchanged."""
    from tests.helpers.saved import saved_by_autograd

    torch.manual_seed(0)
    emb = TTEmbedding(500, 24, row_modes=(5, 10, 10), col_modes=(2, 3, 4), ranks=4,
                      dtype=F64)
    ids = torch.randint(0, 500, (400,))  # about 275 distinct: slices larger than the tables
    _, want = _lookup_grads(emb, ids)
    (_, grads), saved = saved_by_autograd(lambda: _lookup_grads(emb, ids))
    slices = int(torch.unique(ids).numel()) * (1 * 6 * 4 + 4 * 4 * 1) * 8  # pair (0, 1), core 2
    assert saved >= slices
    for g, w in zip(grads, want, strict=True):
        assert torch.equal(g, w)


def test_double_backward_through_regathered_slices():
    torch.manual_seed(0)
    emb = TTEmbedding(500, 24, row_modes=(5, 10, 10), col_modes=(2, 3, 4), ranks=4,
                      dtype=F64)
    ids = torch.randint(0, 500, (90,))  # about 80 distinct: more slices than table rows
    cores = list(emb.parameters())
    assert torch.autograd.gradgradcheck(
        lambda *ps: torch.func.functional_call(emb, dict(zip(
            [n for n, _ in emb.named_parameters()], ps, strict=True)), (ids,)), tuple(cores),
        fast_mode=True)


def test_only_slices_at_least_four_times_their_table_are_regathered(monkeypatch):
    """Kept for the backward, a table adds its bytes to the backward's peak: a slice not much
    larger than its table (few ids, or ids that use most of a pair table's rows) is saved."""
    import contextlib

    seen = []

    def record(recipes):
        seen.append(len(recipes))
        return contextlib.nullcontext()

    monkeypatch.setattr(embedding, "recomputed_in_backward", record)
    torch.manual_seed(0)
    emb = TTEmbedding(30522, 768, row_modes=(16, 20, 10, 10), col_modes=(4, 4, 8, 6), ranks=32)
    emb(torch.randint(0, 30522, (1, 16)))  # 16 ids: every slice smaller than its table
    emb(torch.randint(0, 30522, (32, 128)))  # ~3,700 ids over tables of <= 320 and 100 rows
    assert seen == [0, 2]


def _capturing(monkeypatch) -> None:
    """Make the lookup see a CUDA graph capture in progress on the current stream (what
    ``torch.cuda.graph`` and ``make_graphed_callables`` do), so its capture path runs here."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


@pytest.mark.parametrize("shape", SPARSE_SHAPES, ids=["d3", "d4"])
def test_under_a_cuda_graph_capture_the_lookup_reads_nothing_back_and_equals_eager(
        shape, monkeypatch):
    """A capture fails at any op that reads the device back to the host (unique, bincount,
    int() of a tensor), as the paper transformer's captured step did on an H200: under capture
    the lookup takes whole tables instead, with the same rows and gradients."""
    from tests.helpers.host_reads import HostReads

    layer = _sparse_layer(*shape)
    ids = torch.randint(0, 6000, (3, 40), generator=torch.Generator().manual_seed(3))
    weights = torch.randn(3, 40, 8, dtype=F64)
    eager = layer(ids)
    eager_grads = torch.autograd.grad((eager * weights).sum(), list(layer.parameters()))
    with HostReads() as seen:  # the eager lookup reads the ids back: the check can fail
        layer(ids)
    assert {name for name, _ in seen.reads} >= {"_unique2", "_local_scalar_dense"}
    _capturing(monkeypatch)
    with HostReads() as seen:
        got = layer(ids)
        grads = torch.autograd.grad((got * weights).sum(), list(layer.parameters()))
    assert seen.reads == []
    torch.testing.assert_close(got, eager, rtol=1e-12, atol=1e-12)
    for g, e in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fmt", ["tt", "lowrank"])
def test_a_table_in_another_format_under_capture_reads_nothing_back(fmt, monkeypatch):
    """GatedEmbedding's own lookup (any table format) under capture: no host read, eager's
    rows and gradients."""
    from comera.layers.embedding import GatedEmbedding
    from tests.helpers.host_reads import HostReads

    torch.manual_seed(4)
    modes = {} if fmt == "lowrank" else {"row_modes": (6, 10, 10), "col_modes": (2, 2, 2)}
    layer = GatedEmbedding(600, 8, ranks=3, format=fmt, dtype=F64, **modes)
    ids = torch.randint(0, 600, (50,), generator=torch.Generator().manual_seed(5))
    ids[:4] = ids[4]
    eager = layer(ids)
    eager_grads = torch.autograd.grad(eager.square().sum(), list(layer.parameters()))
    _capturing(monkeypatch)
    with HostReads() as seen:
        got = layer(ids)
        grads = torch.autograd.grad(got.square().sum(), list(layer.parameters()))
    assert seen.reads == []
    torch.testing.assert_close(got, eager, rtol=1e-12, atol=1e-12)
    for g, e in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
