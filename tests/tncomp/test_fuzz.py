"""Fuzzing the public entry points: the builders, ``compile`` and ``contract``, ``parse_spec``.

Hypothesis draws layers (``tt_linear``, ``ttm_linear``, ``ttm_embedding``) and einsum networks
(``from_eq``, ``contract``) with random modes, ranks, batch sizes and dtypes (float32, float64,
complex128), and about one case in three carries a bad value: a zero, negative, non-int or
mismatched size, a malformed equation, a wrong dtype, mixed dtypes, a wrong input shape or
count. Every outcome must be one of two things:

* a result equal to ``torch.einsum`` on the same values in float64 (complex128), within a
  bound of ``TOL_ULPS`` units in the last place of the dtype times ``einsum(|operands|)``
  (the scale rounding errors of a sum of products live on), gradients included; or
* an exception from ``tncomp.errors`` with a non-empty message.

A bare torch or Python exception fails the test. Inputs that once raised one are pinned in
``FIXED_BARE_ERRORS`` with the tncomp error (and builtin base) they raise now. Outcome counts
per test are printed to the terminal when the module ends (``--hypothesis-show-statistics``
adds hypothesis's own timings).
"""

from __future__ import annotations

import math
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tncomp
from tests.helpers.tn import einsum_eq
from tncomp import Dim, Network
from tncomp.cli import parse_spec
from tncomp.errors import IRError, OperandError, OptionError, TncompError

DEFAULT_EXAMPLES = 50
SLOW_EXAMPLES = 1000
TOL_ULPS = 256
DTYPES = (torch.float32, torch.float64, torch.complex128)
OPTIMIZE = ("auto", "search", "flops") * 5 + ("fastest", "", None)  # a few bad choices
OUTCOMES: Counter = Counter()  # (test, outcome) -> count, printed when the module ends


@pytest.fixture(scope="module", autouse=True)
def _report_outcomes(request):
    yield
    plugins = request.config.pluginmanager
    reporter = plugins.get_plugin("terminalreporter")
    capture = plugins.get_plugin("capturemanager")
    if reporter is None or capture is None or not OUTCOMES:
        return
    with capture.global_and_fixture_disabled():  # straight to the terminal, past capturing
        reporter.write_line("")
        reporter.write_line("tncomp fuzz outcomes (cases per test and outcome):")
        for test in sorted({t for t, _ in OUTCOMES}):
            parts = sorted((o, c) for (t, o), c in OUTCOMES.items() if t == test)
            total = sum(c for _, c in parts)
            reporter.write_line(f"  {test}: {total} cases; "
                                + ", ".join(f"{o} {c}" for o, c in parts))


def _expect(test: str, stage: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, or None after a tncomp error (counted); any other exception propagates."""
    try:
        value = fn()
    except TncompError as exc:
        assert str(exc).strip(), f"{type(exc).__name__} with an empty message"
        OUTCOMES[test, f"{stage}:{type(exc).__name__}"] += 1
        return None
    return value


def _real(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if not dtype.is_complex else torch.complex128


def _close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
           what: str) -> None:
    """|got - want| <= TOL_ULPS * eps(dtype) * scale elementwise (scale = |.|-einsum)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    exact = not (dtype.is_floating_point or dtype.is_complex)  # integer operands
    eps = 0.0 if exact else torch.finfo(dtype).eps
    err = (got.detach().to(want.dtype) - want).abs()
    bound = TOL_ULPS * eps * scale + torch.finfo(torch.float64).tiny
    worst = (err - bound).max().item() if err.numel() else 0.0
    assert worst <= 0, f"{what}: error {err.max().item():.3g} beyond {TOL_ULPS} ulps of the scale"


def _compare(test: str, eq: str, args: list, y: torch.Tensor) -> None:
    """``y`` (and, where the operands need them, its gradients) against torch.einsum."""
    dtype = args[0].dtype
    assert y.dtype == dtype, f"result is {y.dtype} for {dtype} operands"
    refs = [t.detach().to(_real(dtype)).requires_grad_(t.requires_grad) for t in args]
    ry = torch.einsum(eq, *refs)
    mags = [r.detach().abs().double().requires_grad_(r.requires_grad) for r in refs]
    scale = torch.einsum(eq, *mags)
    _close(y, ry.detach(), scale.detach(), dtype, "result")
    wanted = [k for k, t in enumerate(args) if t.requires_grad]
    if wanted and y.requires_grad:
        gen = torch.Generator().manual_seed(1)
        dy = torch.randn(ry.shape, generator=gen, dtype=_real(dtype))
        got = torch.autograd.grad(y, [args[k] for k in wanted], dy.to(dtype))
        want = torch.autograd.grad(ry, [refs[k] for k in wanted], dy)
        scales = torch.autograd.grad(scale, [mags[k] for k in wanted], dy.abs())
        for k, g, w, s in zip(wanted, got, want, scales, strict=True):
            assert g.dtype == dtype
            _close(g, w, s, dtype, f"gradient of operand {k}")
        OUTCOMES[test, "result+grads"] += 1
    else:
        OUTCOMES[test, "result"] += 1


def _random(shape, dtype, gen) -> torch.Tensor:
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


# -- call perturbations: what is passed to the compiled network -------------------------------

CALLS = ("ok",) * 12 + ("count", "rank", "size", "int_dtype", "mixed", "noncontig", "nontensor",
                       "zero_size")


def _perturb(tensors: list[torch.Tensor], how: str, pick: int, grad: bool) -> list:
    """The operands as passed: ``how`` breaks (or, for noncontig, only restrides) one of them."""
    args: list = [t.clone() for t in tensors]
    if not args:
        return args
    k = pick % len(args)
    t = args[k]
    if how == "count":
        args = args[:-1] if pick % 2 else [*args, t]
    elif how == "rank":
        args[k] = t.unsqueeze(-1)
    elif how == "size" and t.ndim:
        shape = list(t.shape)
        shape[pick % t.ndim] += 1
        args[k] = torch.zeros(shape, dtype=t.dtype)
    elif how == "int_dtype":
        args[k] = t.real.round().to(torch.int64)
    elif how == "mixed" and not t.is_complex():
        args[k] = t.to(torch.float32 if t.dtype == torch.float64 else torch.float64)
    elif how == "noncontig":
        args = [a.mT.contiguous().mT if a.ndim >= 2 else a for a in args]
    elif how == "nontensor":
        args[k] = t.tolist()
    elif how == "zero_size" and t.ndim:
        shape = list(t.shape)
        shape[pick % t.ndim] = 0
        args[k] = torch.zeros(shape, dtype=t.dtype)
    if grad:
        args = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and
                (a.is_floating_point() or a.is_complex()) else a for a in args]
    return args


def _call(test: str, net: Network, optimize: str, tensors: list[torch.Tensor], how: str,
          pick: int, grad: bool) -> None:
    f = _expect(test, "compile", lambda: tncomp.compile(net, optimize=optimize,
                                                        disk_cache=False))
    if f is None:
        return
    args = _perturb(tensors, how, pick, grad)
    y = _expect(test, "call", lambda: f(*args))
    if y is not None:
        _compare(test, einsum_eq(net), args, y)


def _bound_shapes(net: Network, batch: int) -> list[tuple[int, ...]]:
    sizes = {i: (batch if isinstance(s, Dim) else s) for i, s in net.sizes}
    return [tuple(sizes[i] for i in t.indices) for t in net.operands]


# -- layers: tt_linear, ttm_linear, ttm_embedding ---------------------------------------------

BAD_SIZE = st.one_of(st.integers(-3, 0), st.sampled_from([2.0, 1.5, "3", None, True, False]))


@dataclass(frozen=True)
class LayerCase:
    builder: str
    in_modes: list
    out_modes: list
    ranks: Any
    batch_decl: Any
    batch: int
    dtype: torch.dtype
    optimize: str
    call: str
    pick: int
    grad: bool
    seed: int


@st.composite
def _modes(draw, d: int) -> list:
    modes: list = draw(st.lists(st.integers(1, 3), min_size=d, max_size=d))
    if modes and draw(st.integers(0, 11)) == 0:
        modes[draw(st.integers(0, d - 1))] = draw(BAD_SIZE)
    return modes


@st.composite
def _ranks(draw, n_cores: int):
    kind = draw(st.sampled_from(["max"] * 4 + ["interior", "full", "bad"]))
    if kind == "max":
        return draw(st.integers(1, 3))
    if kind == "interior":
        return draw(st.lists(st.integers(1, 3), min_size=n_cores - 1, max_size=n_cores - 1))
    if kind == "full":
        return [1, *draw(st.lists(st.integers(1, 3), min_size=n_cores - 1,
                                  max_size=n_cores - 1)), 1]
    return draw(st.one_of(
        BAD_SIZE,
        st.lists(st.integers(1, 3), max_size=n_cores + 3),  # (mostly) the wrong length
        st.lists(st.one_of(st.integers(-1, 3), BAD_SIZE), min_size=n_cores + 1,
                 max_size=n_cores + 1),  # zeros, floats, None, ends other than 1
    ))


@st.composite
def layer_cases(draw) -> LayerCase:
    builder = draw(st.sampled_from(["tt_linear", "ttm_linear", "ttm_embedding"]))
    d = draw(st.integers(1, 3))
    d_out = d if draw(st.integers(0, 11)) else draw(st.integers(0, 4))  # mismatched lengths
    in_modes, out_modes = draw(_modes(d)), draw(_modes(d_out))
    ranks = draw(_ranks(2 * d if builder == "tt_linear" else d))
    decl_kind = draw(st.sampled_from(["int", "int", "dim", "dim", "name", "bad"]))
    if decl_kind == "int":
        batch_decl = draw(st.integers(1, 5))
        batch = batch_decl if draw(st.integers(0, 5)) else draw(st.integers(1, 6))
    elif decl_kind == "dim":
        lo = draw(st.integers(1, 3))
        batch_decl = Dim("B", lo, lo + draw(st.integers(0, 6)))
        batch = draw(st.integers(max(lo - 1, 1), lo + 7))  # sometimes out of the bounds
    elif decl_kind == "name":
        batch_decl, batch = "N", draw(st.integers(1, 6))
    else:
        batch_decl = draw(st.one_of(BAD_SIZE, st.sampled_from(["3B", "", "a b", "é!"])))
        batch = 2
    return LayerCase(builder, in_modes, out_modes, ranks, batch_decl, batch,
                     draw(st.sampled_from(DTYPES)), draw(st.sampled_from(OPTIMIZE)),
                     draw(st.sampled_from(CALLS)), draw(st.integers(0, 7)), draw(st.booleans()),
                     draw(st.integers(0, 2**16)))


def check_layer(case: LayerCase, test: str = "layers") -> None:
    build = getattr(tncomp, case.builder)
    net = _expect(test, "build", lambda: build(case.in_modes, case.out_modes, case.ranks,
                                               case.batch_decl))
    if net is None:
        return
    gen = torch.Generator().manual_seed(case.seed)
    tensors = [_random(s, case.dtype, gen) for s in _bound_shapes(net, case.batch)]
    _call(test, net, case.optimize, tensors, case.call, case.pick, case.grad)


# -- einsum networks: from_eq, contract --------------------------------------------------------

EQ_BREAKS = ("ok",) * 10 + ("shape_len", "size_bad", "size_conflict", "eq_char", "out_dangling",
                            "out_repeat", "term_repeat", "n_shapes", "eq_type", "ellipsis")
LETTERS = string.ascii_letters


@dataclass(frozen=True)
class EqCase:
    eq: Any
    shapes: list  # as declared to from_eq (may hold a Dim or a bad size)
    concrete: list  # the shapes of the tensors made for the call
    dtype: torch.dtype
    optimize: str
    call: str
    pick: int
    grad: bool
    seed: int


@st.composite
def eq_cases(draw, symbolic: bool = True) -> EqCase:
    n_ops = draw(st.integers(1, 4))
    letters = draw(st.lists(st.sampled_from(LETTERS), min_size=1, max_size=5, unique=True))
    terms: list[list[str]] = [[] for _ in range(n_ops)]
    sizes = {}
    for c in letters:
        sizes[c] = draw(st.integers(1, 4))
        for h in draw(st.lists(st.integers(0, n_ops - 1), min_size=1, max_size=min(3, n_ops),
                               unique=True)):
            terms[h].append(c)
    terms = [draw(st.permutations(t)) for t in terms]
    present = sorted({c for t in terms for c in t})
    explicit = draw(st.integers(0, 4)) > 0
    out = draw(st.lists(st.sampled_from(present), unique=True)) if present and explicit else []
    concrete = [[sizes[c] for c in t] for t in terms]
    shapes: list = [list(s) for s in concrete]
    if symbolic and present and draw(st.booleans()):
        b = draw(st.sampled_from(present))
        dim = Dim("B", 1, 8)
        shapes = [[dim if c == b else sizes[c] for c in t] for t in terms]
    breaks = draw(st.sampled_from(EQ_BREAKS))
    if breaks == "term_repeat" and present:
        k = draw(st.integers(0, n_ops - 1))
        c = draw(st.sampled_from(present))
        terms[k] = [*terms[k], c]
        shapes[k] = [*shapes[k], sizes[c]]
        concrete[k] = [*concrete[k], sizes[c]]
    eq: Any = ",".join("".join(t) for t in terms) + ("->" + "".join(out) if explicit else "")
    k = draw(st.integers(0, n_ops - 1))
    if breaks == "shape_len":
        shapes[k] = [*shapes[k], 2] if draw(st.booleans()) or not shapes[k] else shapes[k][:-1]
    elif breaks == "size_bad" and shapes[k]:
        shapes[k][draw(st.integers(0, len(shapes[k]) - 1))] = draw(
            st.one_of(BAD_SIZE, st.sampled_from(["1x", "", -5])))
    elif breaks == "size_conflict" and shapes[k]:
        axis = draw(st.integers(0, len(shapes[k]) - 1))
        shapes[k][axis] = concrete[k][axis] = concrete[k][axis] + 1
    elif breaks == "eq_char":
        pos = draw(st.integers(0, len(eq)))
        eq = eq[:pos] + draw(st.sampled_from(["1", "-", ".", "_", "$", "é", ">", "->"])) + eq[pos:]
    elif breaks == "out_dangling":
        eq = eq + ("" if explicit else "->") + draw(st.sampled_from(
            [c for c in LETTERS if c not in present]))
    elif breaks == "out_repeat" and present:
        c = draw(st.sampled_from(present))
        eq = eq + ("" if explicit else "->") + c + c
    elif breaks == "n_shapes":
        if draw(st.booleans()):
            shapes, concrete = shapes[:-1], concrete[:-1]
        else:
            shapes, concrete = [*shapes, [2]], [*concrete, [2]]
    elif breaks == "eq_type":
        eq = draw(st.sampled_from([None, 5, eq.encode(), ["ab"]]))
    elif breaks == "ellipsis":
        eq = "..." + eq
    return EqCase(eq, shapes, concrete, draw(st.sampled_from(DTYPES)),
                  draw(st.sampled_from(OPTIMIZE)), draw(st.sampled_from(CALLS)),
                  draw(st.integers(0, 7)), draw(st.booleans()), draw(st.integers(0, 2**16)))


def check_from_eq(case: EqCase, test: str = "from_eq") -> None:
    net = _expect(test, "build", lambda: tncomp.from_eq(case.eq, *case.shapes))
    if net is None:
        return
    gen = torch.Generator().manual_seed(case.seed)
    tensors = [_random(tuple(s), case.dtype, gen) for s in case.concrete]
    _call(test, net, case.optimize, tensors, case.call, case.pick, case.grad)


def check_contract(case: EqCase, test: str = "contract") -> None:
    gen = torch.Generator().manual_seed(case.seed)
    tensors = [_random(tuple(s), case.dtype, gen) for s in case.concrete]
    args = _perturb(tensors, case.call, case.pick, case.grad)
    y = _expect(test, "contract", lambda: tncomp.contract(case.eq, *args,
                                                          optimize=case.optimize,
                                                          disk_cache=False))
    if y is not None:
        _compare(test, case.eq, args, y)


# -- SPECs of the command line -----------------------------------------------------------------

SPEC_PIECES = ["tt", "ttm", "eq", ":", ":", "x", "|", "|", ",", ",", "=", "modes", "rank", "->",
               "12", "8", "3", "0", "-1", "B", "bi", "ij", "²", " ", ".json", "{}"]


@st.composite
def _layer_spec(draw) -> str:
    d = draw(st.integers(1, 3))
    ins = draw(st.lists(st.integers(1, 4), min_size=d, max_size=d))
    outs = draw(st.lists(st.integers(1, 4), min_size=d, max_size=d))
    n_in, n_out = math.prod(ins), math.prod(outs)
    if draw(st.integers(0, 3)) == 0:  # shape and modes disagree
        n_in += draw(st.integers(-1, 2))
    rank = draw(st.sampled_from(["", ":rank=2", ":rank=1,2", ":rank=0", ":rank=x"]))
    return (f"{draw(st.sampled_from(['tt', 'ttm']))}:{n_in}x{n_out}:modes="
            f"{','.join(map(str, ins))}|{','.join(map(str, outs))}{rank}")


@st.composite
def _eq_spec(draw) -> str:
    case = draw(eq_cases(symbolic=False))
    eq = case.eq if isinstance(case.eq, str) else "ab"
    shapes = "|".join(",".join(draw(st.sampled_from([str(v), str(v), "B", "0", "-1", "²"]))
                               for v in s) for s in case.shapes)
    return f"eq:{eq}:{shapes}"


@st.composite
def specs(draw) -> str:
    kind = draw(st.sampled_from(["layer", "layer", "eq", "eq", "pieces", "text"]))
    if kind == "layer":
        return draw(_layer_spec())
    if kind == "eq":
        return draw(_eq_spec())
    if kind == "pieces":
        return "".join(draw(st.lists(st.sampled_from(SPEC_PIECES), max_size=14)))
    return draw(st.text(max_size=40))


def check_spec(spec: str, test: str = "parse_spec") -> None:
    net = _expect(test, "parse", lambda: parse_spec(spec))
    if net is not None:
        assert isinstance(net, Network)
        OUTCOMES[test, "network"] += 1


# -- the tests: a modest default run, and a slow one with many more cases ----------------------

def _fuzz(strategy, check: Callable, examples: int, name: str):
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=strategy)
    def test(case) -> None:
        check(case, name)

    return test


test_fuzz_layers = _fuzz(layer_cases(), check_layer, DEFAULT_EXAMPLES, "layers")
test_fuzz_from_eq = _fuzz(eq_cases(), check_from_eq, DEFAULT_EXAMPLES, "from_eq")
test_fuzz_contract = _fuzz(eq_cases(symbolic=False), check_contract, DEFAULT_EXAMPLES,
                           "contract")
test_fuzz_parse_spec = _fuzz(specs(), check_spec, 200, "parse_spec")
test_fuzz_layers_many = pytest.mark.slow(
    _fuzz(layer_cases(), check_layer, SLOW_EXAMPLES, "layers (slow)"))
test_fuzz_from_eq_many = pytest.mark.slow(
    _fuzz(eq_cases(), check_from_eq, SLOW_EXAMPLES, "from_eq (slow)"))
test_fuzz_contract_many = pytest.mark.slow(
    _fuzz(eq_cases(symbolic=False), check_contract, SLOW_EXAMPLES, "contract (slow)"))
test_fuzz_parse_spec_many = pytest.mark.slow(
    _fuzz(specs(), check_spec, 5 * SLOW_EXAMPLES, "parse_spec (slow)"))


# -- bare errors once found by fuzzing, now tncomp errors -------------------------------------

def _ab():
    a = torch.randn(3, 4, dtype=torch.float64)
    return a, torch.randn(4, 5, dtype=torch.float64)


def _ab_7():
    return torch.randn(3, 7), torch.randn(7, 5)


# name -> (call, the tncomp error it raises, the builtin it also is, a fragment of the message
# naming the offending value). Each used to raise a bare TypeError or AttributeError.
FIXED_BARE_ERRORS = {
    "contract-list-operand": (
        lambda: tncomp.contract("ij,jk->ik", [[1.0] * 4] * 3, _ab()[1]),
        OperandError, TypeError, "operand 0 is a list"),
    "contract-none-operand": (
        lambda: tncomp.contract("ij,jk->ik", None, _ab()[1]),
        OperandError, TypeError, "operand 0 is None"),
    "contract-eq-list": (
        lambda: tncomp.contract(["ab"], torch.ones(1)), IRError, ValueError, "['ab'] (list)"),
    "contract-eq-tuple": (
        lambda: tncomp.contract(("ab",), torch.ones(1)), IRError, ValueError, "('ab',)"),
    "contract-unknown-option": (
        lambda: tncomp.contract("ij,jk->ik", *_ab(), optimise="flops"),
        OptionError, ValueError, "unknown option 'optimise'"),
    "tt_linear-modes-None": (
        lambda: tncomp.tt_linear(None, [2, 2], 2), IRError, ValueError, "in_modes is None"),
    "ttm_linear-modes-int": (
        lambda: tncomp.ttm_linear(4, [2, 2], 2), IRError, ValueError, "in_modes is 4"),
    "ttm_embedding-modes-None": (
        lambda: tncomp.ttm_embedding([2, 2], None, 2), IRError, ValueError,
        "col_modes is None"),
    "tt_linear-modes-str": (
        lambda: tncomp.tt_linear("22", [2, 2], 2), IRError, ValueError, "in_modes is '22'"),
    "from_eq-shape-int": (
        lambda: tncomp.from_eq("ij,jk->ik", 3, (3, 4)), IRError, ValueError,
        "shape of operand 'T0' ('ij') is 3"),
    "from_eq-shape-None": (
        lambda: tncomp.from_eq("ij,jk->ik", (3, 4), None), IRError, ValueError,
        "shape of operand 'T1' ('jk') is None"),
    "compile-disk_cache-int": (
        lambda: tncomp.compile(tncomp.from_eq("ij,jk->ik", (3, 4), (4, 5)), disk_cache=3),
        OptionError, ValueError, "disk_cache=3 (int)"),
    "compile-disk_cache-bytes": (
        lambda: tncomp.compile(tncomp.from_eq("ij,jk->ik", (3, 4), (4, 5)), disk_cache=b"d"),
        OptionError, ValueError, "disk_cache=b'd' (bytes)"),
    "compile-disk_cache-empty": (
        lambda: tncomp.compile(tncomp.from_eq("ij,jk->ik", (3, 4), (4, 5)), disk_cache=""),
        OptionError, ValueError, "disk_cache=''"),
    "compile-model-str": (
        lambda: tncomp.compile(tncomp.from_eq("ij,jk->ik", (3, 7), (7, 5)), model="cpu",
                               disk_cache=False, optimize="search")(*_ab_7()),
        OptionError, ValueError, "model='cpu' (str); pass a tncomp.DeviceModel"),
    "contract-model-str": (
        lambda: tncomp.contract("ij,jk->ik", *_ab_7(), model="cpu", disk_cache=False),
        OptionError, ValueError, "model='cpu'"),
    "Dim-int-name": (
        lambda: tncomp.tt_linear([2], [2], 1, batch=Dim(3)), IRError, ValueError,
        "Dim name is 3 (int)"),
    "Dim-str-min": (
        lambda: tncomp.tt_linear([2], [2], 1, batch=Dim("B", "1")), IRError, ValueError,
        "min='1' (str)"),
    "Dim-float-max": (
        lambda: Dim("B", 1, 4.0), IRError, ValueError, "max=4.0 (float)"),
    "Dim-bool-min": (
        lambda: Dim("B", True), IRError, ValueError, "min=True (bool)"),
}


@pytest.mark.parametrize("name", sorted(FIXED_BARE_ERRORS))
def test_fixed_bare_errors(name):
    call, error, builtin, fragment = FIXED_BARE_ERRORS[name]
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, builtin)
    assert fragment in str(info.value), str(info.value)
