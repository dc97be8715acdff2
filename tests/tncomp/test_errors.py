"""Bad inputs raise tncomp's named errors, with messages that say what is wrong and where."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import tncomp
from tncomp import Dim, Role
from tncomp.cli import main as cli_main
from tncomp.compiler.problem import Tree, problem_for
from tncomp.errors import IRError, PlanError, SizeError, TncompError


def _compiled_matmul(b=None):
    b = Dim("B", max=8) if b is None else b
    return tncomp.compile(tncomp.from_eq("bj,jk->bk", (b, 3), (3, 4)), disk_cache=False)


def test_error_classes_subclass_builtins():
    assert issubclass(IRError, ValueError) and issubclass(IRError, TncompError)
    assert issubclass(SizeError, ValueError) and issubclass(SizeError, TncompError)
    assert issubclass(PlanError, RuntimeError) and issubclass(PlanError, TncompError)
    with pytest.raises(ValueError):  # user code catching ValueError keeps working
        tncomp.tt_linear([2], [3], 0)


# -- builders ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("ranks", "match"),
    [
        ([1, 2, 2, 2, 2, 1], r"length 6 for 4 cores; give 5 bonds"),  # too long
        ([2, 2], r"length 2 for 4 cores"),  # too short
        ([], r"length 0 for 4 cores"),
        (0, r"ranks=0; a rank is at least 1"),
        (-1, r"ranks=-1; a rank is at least 1"),
        ([2, 0, 2], r"holds 0; every rank is an int >= 1"),
        ([1, 2, -1, 2, 1], r"holds -1"),
        ([2, 2, 2, 2, 2], r"must start and end with 1"),
        ([1, 2, 2, 2, 3], r"must start and end with 1"),
    ],
)
def test_bad_ranks(ranks, match):
    with pytest.raises(IRError, match=match):
        tncomp.tt_linear([2, 3], [3, 2], ranks)


def test_bad_ranks_ttm_and_embedding():
    with pytest.raises(IRError, match="length 4 for 2 cores"):
        tncomp.ttm_linear([2, 3], [3, 2], [1, 2, 2, 1])
    with pytest.raises(IRError, match="at least 1"):
        tncomp.ttm_embedding([2, 3], [3, 2], 0)


@pytest.mark.parametrize("ranks", [2.5, True, None])
def test_rank_of_wrong_type(ranks):
    with pytest.raises(IRError, match="rank"):
        tncomp.tt_linear([2, 3], [3, 2], ranks)


@pytest.mark.parametrize("build", [tncomp.tt_linear, tncomp.ttm_linear, tncomp.ttm_embedding])
def test_bad_modes(build):
    with pytest.raises(IRError, match="differ in length"):
        build([2, 3], [3, 2, 2], 2)
    with pytest.raises(IRError, match="is empty"):
        build([], [], 2)
    with pytest.raises(IRError, match="is empty"):
        build([2], [], 2)
    with pytest.raises(IRError, match="has mode 0; modes are ints >= 1"):
        build([2, 0], [3, 2], 2)
    with pytest.raises(IRError, match="has mode -3"):
        build([2, 3], [-3, 2], 2)
    with pytest.raises(IRError, match=r"has mode 2\.0"):
        build([2.0, 3], [3, 2], 2)


@pytest.mark.parametrize("build", [tncomp.tt_linear, tncomp.ttm_linear, tncomp.ttm_embedding])
@pytest.mark.parametrize("modes", [None, 4, "24", 2.0])
def test_modes_that_are_not_a_sequence(build, modes):
    first = "row_modes" if build is tncomp.ttm_embedding else "in_modes"
    with pytest.raises(IRError, match=rf"{first} is {re.escape(repr(modes))} "
                                      r"\(\w+\); give a sequence of ints such as \(8, 8, 12\)"):
        build(modes, [2, 2], 2)


def test_from_eq_shape_that_is_not_a_sequence():
    with pytest.raises(IRError, match=r"shape of operand 'T1' \('jk'\) is 4; give a sequence "
                                      r"of 2 sizes such as \(2, 3\)"):
        tncomp.from_eq("ij,jk->ik", (3, 4), 4)
    with pytest.raises(IRError, match=r"shape of operand 'x' \('i'\) is None.* \(2,\)"):
        tncomp.from_eq("i->i", None, names=["x"])
    with pytest.raises(IRError, match=r"is 'B3'"):  # a str is not a shape of one-letter sizes
        tncomp.from_eq("ij->ij", "B3")
    assert tncomp.from_eq("ij->ji", torch.Size([2, 3])).size_dict == {"i": 2, "j": 3}


def test_bad_batch_argument():
    with pytest.raises(IRError, match="batch"):
        tncomp.tt_linear([2], [3], 2, batch=2.5)
    with pytest.raises(IRError, match="not an identifier"):
        tncomp.tt_linear([2], [3], 2, batch="not a name")


# -- network structure ------------------------------------------------------------------------

def test_dangling_output_index():
    with pytest.raises(IRError, match="output index 'k' is dangling: no operand carries it"):
        tncomp.make_network([("x", ["i", "j"], Role.INPUT)], ("y", ["i", "k"]),
                            {"i": 2, "j": 3, "k": 4})


def test_dangling_output_index_from_eq_names_the_problem():
    with pytest.raises(IRError, match=r"(?i)dangling|no operand"):
        tncomp.from_eq("ij->ik", (2, 3))


def test_dangling_output_index_from_eq_raises_irerror():
    with pytest.raises(IRError, match="'k'"):
        tncomp.from_eq("ij->ik", (2, 3))


def test_repeated_index_on_one_tensor():
    with pytest.raises(IRError, match=r"index 'i' appears twice on tensor 'T0'.*diagonal"):
        tncomp.from_eq("ii->i", (2, 2))
    with pytest.raises(IRError, match="appears twice on tensor 'w'"):
        tncomp.make_network([("w", ["a", "b", "a"], Role.PARAMETER)], ("y", ["b"]),
                            {"a": 2, "b": 3})


def test_index_on_three_tensors_needs_hyper():
    ops = [(n, ["i"], Role.INPUT) for n in ("a", "b", "c")]
    with pytest.raises(IRError, match=r"'i' appears on 3 tensors \(a, b, c\).*hyper=\{'i'\}"):
        tncomp.make_network(ops, ("y", []), {"i": 2})
    net = tncomp.make_network(ops, ("y", []), {"i": 2}, hyper={"i"})  # declared: fine
    assert net.hyper == frozenset({"i"})
    with pytest.raises(IRError, match="hyperedge 'z' is not an index"):
        tncomp.make_network(ops, ("y", []), {"i": 2}, hyper={"i", "z"})


def test_other_malformed_networks():
    with pytest.raises(IRError, match="empty network"):
        tncomp.make_network([], ("y", []), {})
    with pytest.raises(IRError, match="tensor name 'x' is used twice"):
        tncomp.make_network([("x", ["i"], Role.INPUT), ("x", ["i"], Role.INPUT)], ("y", []),
                            {"i": 2})
    with pytest.raises(IRError, match="'j' has a size but no tensor carries it"):
        tncomp.make_network([("x", ["i"], Role.INPUT)], ("y", ["i"]), {"i": 2, "j": 3})
    with pytest.raises(IRError, match="index 'i' has size 0; sizes must be >= 1"):
        tncomp.make_network([("x", ["i"], Role.INPUT)], ("y", ["i"]), {"i": 0})
    with pytest.raises(IRError, match="has no size"):
        tncomp.make_network([("x", ["i", "j"], Role.INPUT)], ("y", ["i"]), {"i": 2})


def test_from_eq_errors():
    with pytest.raises(IRError, match="index 'j' has size 3 on one operand and 4 on 'T1'"):
        tncomp.from_eq("ij,jk->ik", (2, 3), (4, 5))
    with pytest.raises(IRError, match="has 2 operands but 1 shapes"):
        tncomp.from_eq("ij,jk->ik", (2, 3))
    with pytest.raises(IRError, match="has 2 indices but shape"):
        tncomp.from_eq("ij->ij", (2, 3, 4))
    with pytest.raises(IRError, match=r"'\.\.\.'"):
        tncomp.from_eq("...i->i", ())  # "..." is read; the shape lacks the axis i
    with pytest.raises(IRError, match="letters only"):
        tncomp.from_eq("i1,1j->ij", (2, 3), (3, 2))
    with pytest.raises(IRError, match="size of index 'j'"):
        tncomp.from_eq("ij->i", (2, 3.0))
    with pytest.raises(IRError, match="eq must be a str"):
        tncomp.from_eq(["ij->i"], (2, 3))
    # a symbol name refers to the Dim declared first
    net = tncomp.from_eq("bi,bj->ij", (Dim("B", max=4), 2), ("B", 3))
    assert net.dims == (Dim("B", max=4),)


def test_from_eq_conflicting_bounds_for_one_symbol():
    with pytest.raises(IRError, match="B"):
        tncomp.from_eq("bi,bj->ij", (Dim("B", max=4), 2), (Dim("B"), 3))


def test_dim_bounds_at_construction():
    with pytest.raises(IRError, match="min=0; sizes are at least 1"):
        Dim("B", min=0)
    with pytest.raises(IRError, match="max=2 < min=5"):
        Dim("B", min=5, max=2)
    with pytest.raises(IRError, match="not an identifier"):
        Dim("2B")


@pytest.mark.parametrize(("args", "match"), [
    ((3,), r"Dim name is 3 \(int\); name a symbol with a str such as Dim\('B'\)"),
    ((None,), r"Dim name is None"),
    (("B", "1"), r"Dim 'B' has min='1' \(str\); give an int, e\.g\. Dim\('B', min=1"),
    (("B", 1.0), r"min=1\.0 \(float\)"),
    (("B", True), r"min=True \(bool\)"),
    (("B", 1, "8"), r"max='8' \(str\); give an int or None \(unbounded\)"),
    (("B", 1, 8.5), r"max=8\.5 \(float\)"),
])
def test_dim_types_at_construction(args, match):
    with pytest.raises(IRError, match=match):
        Dim(*args)
    assert Dim("B", 2, None).max is None and Dim("B", 2, 2).max == 2


# -- calls --------------------------------------------------------------------------------------

def test_wrong_operand_count():
    f = _compiled_matmul()
    with pytest.raises(SizeError, match=r"expected 2 tensors \(T0, T1\), got 1"):
        f(torch.randn(2, 3))
    with pytest.raises(SizeError, match="got 3"):
        f(torch.randn(2, 3), torch.randn(3, 4), torch.randn(4))
    with pytest.raises(SizeError, match="got 0"):
        f()


def test_wrong_shape_names_tensor_and_axis():
    f = _compiled_matmul()
    with pytest.raises(SizeError, match=r"tensor 'T1' axis 1 \(k\): expected size 4, got 5"):
        f(torch.randn(2, 3), torch.randn(3, 5))
    with pytest.raises(SizeError, match=r"tensor 'T0' axis 1 \(j\): expected size 3, got 2"):
        f(torch.randn(2, 2), torch.randn(3, 4))
    with pytest.raises(SizeError, match=r"tensor 'T1' should have 2 axes \(j, k\)"):
        f(torch.randn(2, 3), torch.randn(3, 4, 1))


def test_shared_symbol_must_agree():
    f = tncomp.compile(tncomp.from_eq("bi,bj->bij", ("B", 2), ("B", 3)), disk_cache=False)
    with pytest.raises(SizeError, match=r"tensor 'T1' axis 0 \(b\): B=5 disagrees with B=4"):
        f(torch.randn(4, 2), torch.randn(5, 3))


def test_dim_bounds_at_call():
    f = _compiled_matmul(Dim("B", min=2, max=8))
    with pytest.raises(SizeError, match=r"tensor 'T0' axis 0 \(b\): B=9 is outside its bounds "
                                        r"\[2, 8\]"):
        f(torch.randn(9, 3), torch.randn(3, 4))
    with pytest.raises(SizeError, match=r"B=1 is outside its bounds \[2, 8\]"):
        f(torch.randn(1, 3), torch.randn(3, 4))
    with pytest.raises(SizeError, match="outside its bounds"):
        f(torch.randn(0, 3), torch.randn(3, 4))
    assert f(torch.randn(8, 3), torch.randn(3, 4)).shape == (8, 4)


def test_mixed_dtypes():
    f = _compiled_matmul()
    with pytest.raises(SizeError, match=r"tensor 'T1' is torch.float64 .* 'T0' is torch.float32"):
        f(torch.randn(2, 3), torch.randn(3, 4, dtype=torch.float64))


def test_bool_dtype_is_refused():
    f = _compiled_matmul()
    with pytest.raises(SizeError, match=r"dtype torch\.bool; torch multiplies no bool matrices"):
        f(torch.ones(2, 3, dtype=torch.bool), torch.ones(3, 4, dtype=torch.bool))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_integer_dtypes_contract_exactly_without_gradients(dtype):
    f = _compiled_matmul()
    a = torch.arange(6, dtype=dtype).reshape(2, 3)
    b = torch.arange(12, dtype=dtype).reshape(3, 4)
    y = f(a, b)
    assert y.dtype == dtype and torch.equal(y, a @ b) and not y.requires_grad


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_integer_dtypes_on_cuda_are_refused_as_torch_refuses_them():
    f = _compiled_matmul()
    a = torch.ones(2, 3, dtype=torch.int64, device="cuda")
    with pytest.raises(SizeError, match="integer matrix products on the CPU only"):
        f(a, torch.ones(3, 4, dtype=torch.int64, device="cuda"))


@pytest.mark.parametrize("bad", ["list", "float", "numpy"])
def test_non_tensor_operand(bad):
    f = _compiled_matmul()
    value = {"list": [[1.0] * 4] * 3, "float": 1.0, "numpy": np.ones((3, 4))}[bad]
    with pytest.raises(TncompError, match="torch tensors"):
        f(torch.randn(2, 3), value)


def test_non_tensor_operand_raises():
    f = _compiled_matmul()
    with pytest.raises(Exception):  # noqa: B017 - the class is the bug above; it must not pass
        f(torch.randn(2, 3), [[1.0] * 4] * 3)


# -- compile and planning ------------------------------------------------------------------------

def test_compile_rejects_non_network():
    with pytest.raises(TncompError, match=r"compile takes a tncomp\.Network .* got str"):
        tncomp.compile("ij,jk->ik")
    with pytest.raises(TncompError, match="got NoneType"):
        tncomp.compile(None)


def test_unknown_optimize():
    net = tncomp.from_eq("ij->ji", (2, 3))
    with pytest.raises(TncompError, match="optimize='fast'; choose one of auto, search, flops"):
        tncomp.compile(net, optimize="fast")


def test_regimes_need_exactly_one_symbol():
    fixed = tncomp.compile(tncomp.from_eq("ij->ji", (2, 3)), disk_cache=False)
    with pytest.raises(TncompError, match="exactly one symbolic size; this network has 0"):
        fixed.regimes()
    two = tncomp.compile(tncomp.from_eq("bi,ci->bc", ("B", 2), ("C", 2)), disk_cache=False)
    with pytest.raises(TncompError, match=r"has 2 \(B, C\)"):
        two.regimes()


def test_invalid_trees_and_unbound_lowering():
    with pytest.raises(PlanError, match="needs 2 steps, got 1"):
        Tree(3, ((0, 1),))
    with pytest.raises(PlanError, match="uses node"):
        Tree(2, ((0, 0),))
    with pytest.raises(PlanError, match="uses node"):
        Tree(3, ((0, 1), (1, 2)))
    from tncomp.compiler.plan import lower

    net = tncomp.from_eq("bi,ij->bj", ("B", 2), (2, 3))
    problem = problem_for(net)
    with pytest.raises(PlanError, match="unbound size"):
        lower(problem, Tree(2, ((0, 1),)), (True, True))
    bound = problem_for(net, {"b": 4})
    with pytest.raises(PlanError, match="needs_grad has 1 entries for 2 operands"):
        lower(bound, Tree(2, ((0, 1),)), (True,))


# -- the CLI ------------------------------------------------------------------------------------

BAD_SPECS = {
    "no_modes": ("tt:768x3072", "needs modes="),
    "bad_shape": ("tt:axb:modes=2|3", "INxOUT"),
    "modes_mismatch": ("tt:768x3072:modes=12,8,8|12,16,15", "modes multiply to"),
    "bad_rank": ("tt:768x3072:modes=12,8,8|12,16,16:rank=abc", "not a comma-separated list"),
    "zero_rank": ("tt:768x3072:modes=12,8,8|12,16,16:rank=0", "a rank is at least 1"),
    "rank_len": ("ttm:6x6:modes=2,3|3,2:rank=2,2,2,2", "has length 4"),
    "unknown_kind": ("foo:1", "is not understood"),
    "eq_no_shapes": ("eq:bi,ij->bj", "write eq:EQUATION:SHAPES"),
    "eq_axes": ("eq:bi,ij->bj:B,3|3", "has 2 indices but shape"),
    "eq_conflict": ("eq:bi,ij->bj:B,3|4,5", "a shared index needs one size"),
    "missing_file": ("no/such/net.json", "does not exist"),
}


def _run_cli(capsys, *argv):
    code = cli_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_cli_bad_spec_is_one_line_exit_2(case, capsys):
    spec, match = BAD_SPECS[case]
    code, out, err = _run_cli(capsys, "inspect", spec)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tncomp: error: ")
    assert match in lines[0]


def test_cli_bad_json_content(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = _run_cli(capsys, "inspect", str(bad))
    assert code == 2 and "is not valid JSON" in err and len(err.strip().splitlines()) == 1
    neither = tmp_path / "neither.json"
    neither.write_text(json.dumps({"foo": 1}))
    code, _, err = _run_cli(capsys, "inspect", str(neither))
    assert code == 2 and "needs an 'eq', 'tt' or 'ttm' entry" in err


@pytest.mark.parametrize("content", ['{"tt": {}}', '{"tt": {"in_modes": [2], "out_modes": [3]}}',
                                     '"eq"', "5", '{"eq": "ij->j", "shapes": 3}'])
def test_cli_malformed_json_spec(tmp_path, capsys, content):
    spec = tmp_path / "net.json"
    spec.write_text(content)
    code, _, err = _run_cli(capsys, "inspect", str(spec))
    assert code == 2 and err.startswith("tncomp: error: ")


@pytest.mark.parametrize("batch", ["0", "-3"])
def test_cli_batch_outside_bounds(capsys, batch):
    code, _, err = _run_cli(capsys, "inspect", "tt:6x6:modes=2,3|3,2:rank=2", "--batch", batch)
    assert code == 2 and "outside its bounds" in err


def test_cli_valid_spec_and_cache_commands(capsys):
    code, out, err = _run_cli(capsys, "inspect", "eq:ij,jk->ik:2,3|3,4")
    assert code == 0 and err == "" and "gemm" in out
    code, out, _ = _run_cli(capsys, "cache", "info")
    assert code == 0 and "plans" in out and "disk_dir" in out
    with pytest.raises(SystemExit) as exc:
        cli_main(["frobnicate"])
    assert exc.value.code == 2
    capsys.readouterr()


def test_cli_subprocess_malformed_spec():
    """The real entry point: exit code 2, one line on stderr, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "tncomp.cli", "inspect", "tt:768x3072"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tncomp: error: ")


@pytest.mark.parametrize("batch", [0, 101])
def test_inspect_batch_outside_dim_bounds(batch):
    net = tncomp.tt_linear([3, 5], [2, 7], 3, batch=Dim("B", max=100))
    with pytest.raises(SizeError, match="outside its bounds"):
        tncomp.inspect(net, disk_cache=False, batch=batch)


def test_inspect_default_batch_is_clipped_to_the_bounds():
    net = tncomp.tt_linear([3, 5], [2, 7], 3, batch=Dim("B", max=100))
    assert "plan at B=100" in tncomp.inspect(net, disk_cache=False)
