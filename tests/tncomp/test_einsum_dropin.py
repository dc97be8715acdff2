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
