"""``tncomp.contract`` is a drop-in for ``torch.einsum``: opt_einsum's own test equations.

The equations are opt_einsum's (version 3.4.0): the curated ``tests`` list of
``opt_einsum/tests/test_contract.py`` (copied below as data, in its order, with its shapes from
``opt_einsum.testing.build_shapes``), the ``...`` cases of ``opt_einsum/tests/test_input.py``
(whose ``build_views`` reads ``...`` as two axes ``ij`` of sizes 5 and 4, and whose
``test_singleton_dimension_broadcast`` broadcasts size-1 axes), the scalar cases of
``opt_einsum/tests/test_edge_cases.py``, and the grid of ``test_rand_equation`` in
test_contract.py (``opt_einsum.testing.rand_equation``, seed 42). Before diagonals and ``...``
were supported, contract refused 22 of them.

Every equation is checked in float64 against ``torch.einsum``, forward and gradients (autograd
through ``torch.einsum``); a sample passes ``gradcheck``. The default run takes every equation
with a diagonal or ``...`` and a fixed sample of the others; ``-m slow`` runs them all.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from opt_einsum.testing import build_shapes, rand_equation

import tncomp
from tests.helpers.tn import F64
from tncomp.compiler.einsum import parse_eq
from tncomp.errors import DtypeError

TOL = {"rtol": 1e-10, "atol": 1e-10}

# opt_einsum/tests/test_contract.py, ``tests`` (opt_einsum 3.4.0), verbatim.
CONTRACT_TESTS = [
    # Test scalar-like operations
    "a,->a", "ab,->ab", ",ab,->ab", ",,->",
    # Test hadamard-like products
    "a,ab,abc->abc", "a,b,ab->ab",
    # Test index-transformations
    "ea,fb,gc,hd,abcd->efgh", "ea,fb,abcd,gc,hd->efgh", "abcd,ea,fb,gc,hd->efgh",
    # Test complex contractions
    "acdf,jbje,gihb,hfac,gfac,gifabc,hfac", "acdf,jbje,gihb,hfac,gfac,gifabc,hfac",
    "cd,bdhe,aidb,hgca,gc,hgibcd,hgac", "abhe,hidj,jgba,hiab,gab",
    "bde,cdh,agdb,hica,ibd,hgicd,hiac", "chd,bde,agbc,hiad,hgc,hgi,hiad",
    "chd,bde,agbc,hiad,bdi,cgh,agdb", "bdhe,acad,hiab,agac,hibd",
    # Test collapse
    "ab,ab,c->", "ab,ab,c->c", "ab,ab,cd,cd->", "ab,ab,cd,cd->ac", "ab,ab,cd,cd->cd",
    "ab,ab,cd,cd,ef,ef->",
    # Test outer prodcuts
    "ab,cd,ef->abcdef", "ab,cd,ef->acdf", "ab,cd,de->abcde", "ab,cd,de->be", "ab,bcd,cd->abcd",
    "ab,bcd,cd->abd",
    # Random test cases that have previously failed
    "eb,cb,fb->cef", "dd,fb,be,cdb->cef", "bca,cdb,dbf,afc->", "dcc,fce,ea,dbf->ab",
    "fdf,cdd,ccd,afe->ae", "abcd,ad", "ed,fcd,ff,bcf->be", "baa,dcf,af,cde->be", "bd,db,eac->ace",
    "fff,fae,bef,def->abd", "efc,dbc,acf,fd->abe",
    # Inner products
    "ab,ab", "ab,ba", "abc,abc", "abc,bac", "abc,cba",
    # GEMM test cases
    "ab,bc", "ab,cb", "ba,bc", "ba,cb", "abcd,cd", "abcd,ab", "abcd,cdef", "abcd,cdef->feba",
    "abcd,efdc",
    # Inner than dot
    "aab,bc->ac", "ab,bcc->ac", "aab,bcc->ac", "baa,bcc->ac", "aab,ccb->ac",
    # Randomly build test caes
    "aab,fa,df,ecc->bde", "ecb,fef,bad,ed->ac", "bcf,bbb,fbf,fc->", "bb,ff,be->e",
    "bcb,bb,fc,fff->", "fbb,dfd,fc,fc->", "afd,ba,cc,dc->bf", "adb,bc,fa,cfc->d",
    "bbd,bda,fc,db->acf", "dba,ead,cad->bce", "aef,fbc,dca->bde",
]

# opt_einsum/tests/test_input.py: test_compare's list and the test_ellipse_input* strings.
INPUT_TESTS = ["...a->...", "a...->...", "a...a->...a", "...,...", "a,b", "...a,...b",
               "...a", "...a->...a", "...b,...a->..."]
_INPUT_SIZES = dict(zip("abcdefghij", (2, 3, 4, 5, 4, 3, 2, 6, 5, 4), strict=True))

# opt_einsum/tests/test_input.py test_singleton_dimension_broadcast, and
# opt_einsum/tests/test_edge_cases.py test_contract_with_assumed_shapes (scalars as 0-d tensors).
EXPLICIT = [
    ("ij,ij->j", [(10, 2), (1, 2)]),
    ("...ij,...jk->...ik", [(1, 5), (1, 5)]),
    ("...ij,...jk->...ik", [(1, 5), (5, 5)]),
    (",,->", [(), (), ()]),
    ("ab,->", [(2, 2), ()]),
    ("ab,bc->ac", [(2, 2), (2, 2)]),
]


def _rand_equations() -> list[tuple[str, list[tuple[int, ...]]]]:
    """test_contract.py test_rand_equation's grid (it seeds NumPy's global generator with 42;
    the state is restored after)."""
    state = np.random.get_state()
    try:
        cases = []
        for n in (4, 5):
            for reg in (2, 3):
                for n_out in (0, 2, 4):
                    for global_dim in (False, True):
                        eq, shapes = rand_equation(n, reg, n_out, d_min=2, d_max=5, seed=42,
                                                   global_dim=global_dim)
                        cases.append((eq, [tuple(int(v) for v in s) for s in shapes]))
        return cases
    finally:
        np.random.set_state(state)


def _cases() -> list[tuple[str, str, list[tuple[int, ...]]]]:
    cases = [(f"contract{k}", eq, [tuple(s) for s in build_shapes(eq)])
             for k, eq in enumerate(CONTRACT_TESTS)]
    cases += [(f"input{k}", eq, [tuple(_INPUT_SIZES[c] for c in term.replace("...", "ij"))
                                 for term in eq.split("->")[0].split(",")])
              for k, eq in enumerate(INPUT_TESTS)]
    cases += [(f"explicit{k}", eq, shapes) for k, (eq, shapes) in enumerate(EXPLICIT)]
    cases += [(f"rand{k}", eq, shapes) for k, (eq, shapes) in enumerate(_rand_equations())]
    return cases


CASES = _cases()


def _is_new_form(eq: str, shapes) -> bool:
    """A diagonal, '...' or a size-1 broadcast: what contract refused before."""
    parsed = parse_eq(eq, *shapes)
    return parsed.has_diagonals or "..." in eq or any("~" in i for i, _ in parsed.sizes)


def _params():
    sample = set(random.Random(0).sample(range(len(CASES)), 12))
    for k, (name, eq, shapes) in enumerate(CASES):
        fast = _is_new_form(eq, shapes) or k in sample
        marks = [] if fast else [pytest.mark.slow]
        yield pytest.param(eq, shapes, id=f"{name}:{eq}", marks=marks)


def _tensors(shapes, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=F64, requires_grad=True) for s in shapes]


@pytest.mark.parametrize(("eq", "shapes"), list(_params()))
def test_contract_equals_torch_einsum_forward_and_gradients(eq, shapes, one_thread):
    ts = _tensors(shapes, seed=len(eq))
    refs = [t.detach().clone().requires_grad_() for t in ts]
    y = tncomp.contract(eq, *ts, disk_cache=False)
    ry = torch.einsum(eq, *refs)
    assert y.shape == ry.shape and y.dtype == F64
    torch.testing.assert_close(y, ry, **TOL)
    dy = torch.randn(ry.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    for g, r in zip(torch.autograd.grad(y, ts, dy), torch.autograd.grad(ry, refs, dy),
                    strict=True):
        torch.testing.assert_close(g, r, **TOL)


@pytest.mark.parametrize(("eq", "shapes"), list(_params()))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_integer_operands_give_einsums_exact_values(eq, shapes, dtype, one_thread):
    """Integer operands contract exactly (issue 34, item 13: contract refused the int64
    operands torch.einsum takes), in the operands' dtype throughout: int64 gives einsum's very
    result; for narrower integers einsum promotes some sums to int64 (and then refuses to mix
    them), contract keeps the operands' dtype and the same values."""
    gen = torch.Generator().manual_seed(len(eq))
    ts = [torch.randint(-3, 4, s, generator=gen, dtype=dtype) for s in shapes]
    expected = torch.einsum(eq, *[t.long() for t in ts])
    y = tncomp.contract(eq, *ts, disk_cache=False)
    assert y.dtype == dtype and not y.requires_grad
    assert torch.equal(y.long(), expected)
    if dtype == torch.int64:
        assert torch.equal(y, torch.einsum(eq, *ts))


def test_bool_operands_are_refused_with_the_reason():
    a = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(DtypeError, match="torch multiplies no bool matrices"):
        tncomp.contract("ij,jk->ik", a, a.T)


def test_the_list_is_opt_einsums_and_holds_what_was_refused():
    import opt_einsum

    if opt_einsum.__version__ == "3.4.0":  # the copy is verbatim
        from opt_einsum.tests.test_contract import tests

        assert tests == CONTRACT_TESTS
    new = [eq for _, eq, shapes in CASES if _is_new_form(eq, shapes)]
    assert len(new) >= 22  # the 22 refused in the audit (issue 12), plus size-1 broadcasts


# Equations of the list above at sizes 2-3, so the numerical Jacobian stays small.
GRADCHECK = [
    ("aab,bcc->ac", [(2, 2, 3), (3, 2, 2)]),
    ("a...a->...a", [(2, 3, 2, 2)]),
    ("bbd,bda,fc,db->acf", [(3, 3, 2), (3, 2, 2), (2, 3), (2, 3)]),
    ("...ij,...jk->...ik", [(1, 2, 3), (2, 3, 2)]),
    ("ij,ij->j", [(3, 2), (1, 2)]),
    ("fff,fae,bef,def->abd", [(2, 2, 2), (2, 3, 2), (3, 2, 2), (2, 2, 2)]),
]


@pytest.mark.parametrize(("eq", "shapes"), GRADCHECK, ids=[eq for eq, _ in GRADCHECK])
def test_gradcheck_on_a_sample(eq, shapes, one_thread):
    assert eq in {e for _, e, _ in CASES}
    ts = _tensors(shapes, seed=2)
    assert torch.autograd.gradcheck(lambda *xs: tncomp.contract(eq, *xs, disk_cache=False), ts)


# -- how equations are read -------------------------------------------------------------------

def test_diagonals_are_views_before_planning():
    parsed = parse_eq("aab,bcc->ac", (2, 2, 3), (3, 4, 4))
    assert parsed.terms == (("a", "a", "b"), ("b", "c", "c"))
    assert parsed.diagonals == (((0, 1),), ((1, 2),))  # torch.diagonal appends the diagonal
    assert parsed.planned_terms == (("b", "a"), ("b", "c"))
    net = parsed.network()
    assert [t.indices for t in net.operands] == [("b", "a"), ("b", "c")]
    assert parse_eq("iii->i", (3, 3, 3)).diagonals == (((0, 1), (0, 1)),)


def test_ellipsis_and_size_one_broadcasting_become_indices():
    # '...' axes are right-aligned; a size-1 axis against another size gets its own index.
    net = tncomp.from_eq("...ij,...jk", (2, 1, 3, 4), (5, 4, 2))
    assert [t.indices for t in net.operands] == [(".0", ".1~0", "i", "j"), (".1", "j", "k")]
    assert net.output.indices == (".0", ".1", "i", "k")  # implicit: '...' first
    assert net.size_dict[".1~0"] == 1 and net.size_dict[".1"] == 5
    # '...' in the output only stands for no axes, as in torch.einsum.
    assert tncomp.from_eq("ad,db->...a", (3, 2), (2, 3)).output.indices == ("a",)
    net = tncomp.from_eq("bi,bi->b", ("B", 3), (1, 3))
    assert [t.indices for t in net.operands] == [("b", "i"), ("b~1", "i")]
    f = tncomp.compile(net, disk_cache=False)
    x, w = torch.randn(6, 3, dtype=F64), torch.randn(1, 3, dtype=F64)
    torch.testing.assert_close(f(x, w), torch.einsum("bi,bi->b", x, w), **TOL)


def test_contract_keeps_non_contiguous_inputs_and_gradients_through_the_view():
    base = torch.randn(4, 6, 6, dtype=F64)
    x = base[:, ::2, ::2].transpose(1, 2).requires_grad_()  # strided, not contiguous
    w = torch.randn(3, 5, dtype=F64, requires_grad=True)
    y = tncomp.contract("bii,ij->bj", x, w, disk_cache=False)
    ry = torch.einsum("bii,ij->bj", x, w)
    torch.testing.assert_close(y, ry, **TOL)
    got = torch.autograd.grad(y.sum(), (x, w))
    want = torch.autograd.grad(ry.sum(), (x, w))
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, **TOL)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: parse_eq("ii->i", (3, 4)), r"index 'i' repeats on operand 'T0' .* sizes 3 and 4"),
    (lambda: parse_eq("ii->i", (1, 3)), r"sizes 1 and 3"),
    (lambda: parse_eq("...a,...b", (3, 2), (4, 3)),
     r"an axis of '\.\.\.' has size 3 on one operand and 4 on 'T1'"),
    (lambda: parse_eq("ij,jk->ik", (2, 3), (4, 5)),
     r"index 'j' has size 3 on one operand and 4 on 'T1' \(3 on 'T0'\).*or 1, which broadcasts"),
    (lambda: parse_eq("i->ii", (3,)), r"output index 'i' appears twice"),
    (lambda: parse_eq("i->i->i", (3,)), r"more than one '->'"),
    (lambda: parse_eq("i.j->ij", (3, 4)), r"letters only, plus at most one '\.\.\.'"),
    (lambda: parse_eq("......i", (3,)), r"letters only"),
    (lambda: parse_eq("ab...->a", (3,)), r"names 2 axes besides '\.\.\.' but shape \(3,\)"),
    (lambda: parse_eq("ij->k", (2, 3)), r"output index 'k' .* is dangling"),
    (lambda: tncomp.from_eq("ii->i", (2, 2)),
     r"index 'i' appears twice on tensor 'T0'.*diagonal.*tncomp\.contract"),
    (lambda: tncomp.contract("ii->i", torch.ones(2, 3)), r"sizes 2 and 3"),
], ids=["diag-sizes", "diag-size-one", "ellipsis-sizes", "shared-sizes", "output-twice",
        "two-arrows", "stray-dot", "two-ellipses", "too-few-axes",
        "dangling", "from-eq-diagonal", "contract-diag-sizes"])
def test_bad_equations_name_the_problem(call, match):
    with pytest.raises(tncomp.errors.IRError, match=match) as info:
        call()
    assert isinstance(info.value, ValueError)


# -- what else torch.einsum takes (issue 24): size-0 axes, sublists, a list of operands -------

EMPTY = [
    ("bi,ij->bj", [(0, 3), (3, 4)]),  # an empty batch: an empty result
    ("ij,jk->ik", [(2, 0), (0, 3)]),  # an empty contracted axis: zeros
    ("i,i->", [(0,), (0,)]),  # a scalar zero
    ("ij->", [(0, 5)]),
    ("bi,ij,jk->bk", [(0, 3), (3, 4), (4, 5)]),
    ("ab,cd->abcd", [(0, 2), (3, 4)]),
    ("...ij,...jk->...ik", [(0, 2, 3), (3, 4)]),
    ("aab,bc->ac", [(2, 2, 0), (0, 3)]),
    ("ij,ij->j", [(1, 0), (5, 0)]),  # a size-1 axis broadcast next to an empty one
    ("bi,bi->b", [(0, 3), (1, 3)]),
]


def _assert_like_einsum(y, refs, ry, ts) -> None:
    assert y.shape == ry.shape and y.dtype == ry.dtype
    torch.testing.assert_close(y, ry, **TOL)
    dy = torch.randn(ry.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    got = torch.autograd.grad(y, ts, dy, allow_unused=True)
    want = torch.autograd.grad(ry, refs, dy, allow_unused=True)
    for t, g, r in zip(ts, got, want, strict=True):
        g = torch.zeros_like(t) if g is None else g
        r = torch.zeros_like(t) if r is None else r
        assert g.shape == t.shape
        torch.testing.assert_close(g, r, **TOL)


@pytest.mark.parametrize(("eq", "shapes"), EMPTY, ids=[eq for eq, _ in EMPTY])
def test_size_zero_axes_give_einsums_result_and_gradients(eq, shapes):
    ts = _tensors(shapes, seed=3)
    refs = [t.detach().clone().requires_grad_() for t in ts]
    y = tncomp.contract(eq, *ts, disk_cache=False)
    _assert_like_einsum(y, refs, torch.einsum(eq, *refs), ts)


SUBLISTS = [
    ([(3, 4), [0, 1], (4, 5), [1, 2]], None),  # implicit output
    ([(3, 4), [0, 1], (4, 5), [1, 2]], [2, 0]),
    ([(2, 3, 4), [Ellipsis, 0, 1], (4, 5), [1, 2]], [Ellipsis, 0, 2]),
    ([(3, 4), [30, 1], (4, 5), [1, 51]], None),  # letters past 'Z': torch's order
    ([(3, 3, 4), [0, 0, 1], (4,), [1]], [0]),  # a diagonal
    ([(0, 4), [0, 1], (4, 5), [1, 2]], [0, 2]),  # and an empty batch
]


@pytest.mark.parametrize(("args", "output"), SUBLISTS, ids=[str(k) for k in range(len(SUBLISTS))])
def test_the_sublist_form_equals_torch_einsum(args, output):
    shapes, terms = args[0::2], args[1::2]
    ts = _tensors(shapes, seed=4)
    refs = [t.detach().clone().requires_grad_() for t in ts]
    tail = [] if output is None else [output]
    call = [x for t, term in zip(ts, terms, strict=True) for x in (t, term)] + tail
    ref_call = [x for t, term in zip(refs, terms, strict=True) for x in (t, term)] + tail
    y = tncomp.contract(*call, disk_cache=False)
    _assert_like_einsum(y, refs, torch.einsum(*ref_call), ts)


@pytest.mark.parametrize("wrap", [list, tuple])
def test_one_list_of_operands_equals_torch_einsum(wrap):
    ts = _tensors([(3, 4), (4, 5)], seed=5)
    refs = [t.detach().clone().requires_grad_() for t in ts]
    y = tncomp.contract("ij,jk->ik", wrap(ts), disk_cache=False)
    _assert_like_einsum(y, refs, torch.einsum("ij,jk->ik", wrap(refs)), ts)
    again = tncomp.contract("ij,jk->ik", wrap(ts))  # the default options' fast path
    torch.testing.assert_close(again, y.detach(), **TOL)


SECRET = 123456.75  # a value no error message may print


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda a: tncomp.contract(a, "ij"), tncomp.errors.IRError, r"item 1 is 'ij' \(str\)"),
    (lambda a: tncomp.contract(a, [0, 99]), tncomp.errors.IRError, r"holds 99 \(int\)"),
    (lambda a: tncomp.contract(a, [0, 1], [0, 1], [1, 2]), tncomp.errors.OperandError,
     r"item 2 is \[0, 1\] \(list\), not a tensor"),
    (lambda a: tncomp.contract(a, [0, 1], a, [1, 2], "ik"), tncomp.errors.IRError,
     r"output sublist .* is 'ik' \(str\)"),
    (lambda a: tncomp.contract(3, a), tncomp.errors.IRError, r"got 3 \(int\)"),
    (lambda a: tncomp.contract("ij,jk->ik", a, a.float()), tncomp.errors.DtypeError,
     r"float32"),
    (lambda a: tncomp.contract("ij,jk->ik", a[:0], a.float()), tncomp.errors.DtypeError,
     r"float32"),
    (lambda a: tncomp.contract("ij,jk->ik", a, a[:2]), tncomp.errors.IRError,
     r"size 3 on one operand and 2"),
    (lambda a: tncomp.contract("ij,jk->ik", a[:0], a[:2]), tncomp.errors.IRError,
     r"size 3 on one operand and 2"),
], ids=["str-sublist", "int-out-of-range", "sublist-as-operand", "str-output", "int-eq",
        "dtypes", "empty-dtypes", "sizes", "empty-sizes"])
def test_errors_show_shapes_and_dtypes_never_values(call, error, match):
    a = torch.full((3, 3), SECRET, dtype=F64)
    with pytest.raises(error, match=match) as info:
        call(a)
    assert "123456" not in str(info.value)
