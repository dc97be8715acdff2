"""Pictures: ``tncomp draw`` / ``draw_network`` and ``tncomp plot-costs`` / ``plot_costs``.

The numbers behind each picture are checked against hand computations: the FLOPs of each
contraction of the drawn tree from the einsum letters, the dense layer's FLOPs and modelled
time from its GEMM shapes, the candidates' FLOPs from cost.py's formulas. Pictures are read
back and must be real images (size, colours). The command line is run in-process for speed
and, for its exit codes and stderr, in a subprocess.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import sympy

import tncomp
from tests.helpers import ROOT
from tncomp import Dim, cost_curves, draw_network, drawing_of, plot_costs
from tncomp.cli import main
from tncomp.compiler.cost import tree_costs
from tncomp.compiler.device_model import DeviceModel
from tncomp.compiler.problem import Tree, problem_for
from tncomp.errors import PlotDependencyError, PlotError, SizeError, TncompError
from tncomp.views.costplot import plotted_batches
from tncomp.views.draw import representative_batch, tree_layout

TT_SPEC = "tt:15x14:modes=3,5|2,7:rank=3"
MODEL = DeviceModel(2e9, 1e9, 5e-6, "test model")


@pytest.fixture(autouse=True)
def _fresh_plans():
    tncomp.clear_cache()
    yield
    tncomp.clear_cache()


def _image_stats(path: Path) -> tuple[int, int, int]:
    """(height, width, number of distinct colours) of a picture file."""
    img = matplotlib.image.imread(path)  # (H, W, 3 or 4), floats in [0, 1]
    rgb = np.round(np.asarray(img)[..., :3] * 255).astype(np.int64)  # (H, W, 3)
    codes = (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]  # (H, W)
    return img.shape[0], img.shape[1], len(np.unique(codes))


def _assert_real_picture(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 10_000
    h, w, colours = _image_stats(path)
    assert h >= 400 and w >= 800, (h, w)
    assert colours > 50, colours  # text, lines and fills in several colours, not a blank


def _flops_by_hand(terms: list[str], out: str, sizes: dict[str, int], tree: Tree) -> list[int]:
    """2 x the product of all letters of each pairwise contraction, where a node keeps the
    letters still needed by a tensor outside it or by the output."""
    letters = [set(t) for t in terms]
    covers = [{k} for k in range(len(terms))]
    flops = []
    for a, b in tree.steps:
        union = letters[a] | letters[b]
        flops.append(2 * math.prod(sizes[c] for c in union))
        cover = covers[a] | covers[b]
        outside = set(out).union(*(set(terms[k]) for k in range(len(terms)) if k not in cover))
        letters.append(union & outside)
        covers.append(cover)
    return flops


# -- draw_network ------------------------------------------------------------------------------

def test_drawing_of_einsum_chain_labels_and_step_flops():
    net = tncomp.from_eq("bi,ij,jk,kl->bl", ("B", 3), (3, 4), (4, 5), (5, 2))
    d = drawing_of(net, batch=10)
    assert d.batch == 10 and d.path is None
    assert dict(d.bond_labels) == {"b": "b=B", "i": "i=3", "j": "j=4", "k": "k=5", "l": "l=2"}
    assert d.open_indices == ("b", "l") and d.summed_indices == () and d.hyperedges == ()
    sizes = {"b": 10, "i": 3, "j": 4, "k": 5, "l": 2}
    assert list(d.step_flops) == _flops_by_hand(["bi", "ij", "jk", "kl"], "bl", sizes, d.tree)
    assert len(d.tree.steps) == 3


def test_draw_tt_layer_uses_the_regime_tree_and_its_flops(tmp_path):
    net = tncomp.tt_linear([3, 5], [2, 7], 3)
    compiled = tncomp.compile(net, disk_cache=False)
    d = draw_network(compiled, tmp_path / "tt.png", batch=64)
    assert d.path == tmp_path / "tt.png"
    _assert_real_picture(d.path)
    assert d.tree == compiled.regimes().tree_for(64)
    assert set(d.open_indices) == set(net.output.indices)
    assert d.summed_indices == ("r0", "r4")  # the train's size-1 ends
    assert d.bond_labels["b"] == "b=B" and d.bond_labels["r2"] == "r2=3"
    terms = ["".join(chr(97 + sorted(net.size_dict).index(i)) for i in t.indices)
             for t in net.operands]
    out = "".join(chr(97 + sorted(net.size_dict).index(i)) for i in net.output.indices)
    sizes = {chr(97 + k): (64 if isinstance(s, Dim) else s)
             for k, (_, s) in enumerate(sorted(net.sizes))}
    assert list(d.step_flops) == _flops_by_hand(terms, out, sizes, d.tree)


def test_drawing_default_batch_and_fixed_size_networks(tmp_path):
    assert drawing_of(tncomp.tt_linear([3, 5], [2, 7], 3)).batch == 4096
    bounded = tncomp.tt_linear([3, 5], [2, 7], 3, batch=Dim("B", 2, 100))
    assert drawing_of(bounded).batch == 100  # clipped to the bounds
    fixed = tncomp.from_eq("ab,bc->ac", (3, 4), (4, 5))
    d = draw_network(fixed, tmp_path / "c.svg")
    assert d.batch is None and d.step_flops == (2 * 3 * 4 * 5,)
    assert (tmp_path / "c.svg").read_text().lstrip().startswith("<?xml")
    with pytest.raises(SizeError, match="no symbolic size"):
        drawing_of(fixed, batch=8)
    with pytest.raises(SizeError, match=r"B=500 is outside its bounds \[2, 100\]"):
        drawing_of(bounded, batch=500)
    with pytest.raises(SizeError, match="give an int"):
        representative_batch(bounded, 8.5, "draw")


def test_drawing_of_embedding_hyperedge_and_single_tensor():
    d = drawing_of(tncomp.ttm_embedding([4, 5], [2, 3], 2), batch=16)
    assert d.hyperedges == ("b",) and "b" in d.open_indices
    one = drawing_of(tncomp.from_eq("ab->a", ("B", 3)), batch=5)
    assert one.tree.steps == () and one.step_flops == ()
    assert one.summed_indices == ("b",) and one.open_indices == ("a",)


@pytest.mark.slow
def test_draw_embedding_and_single_tensor_pictures(tmp_path):
    _assert_real_picture(draw_network(tncomp.ttm_embedding([4, 5], [2, 3], 2),
                                      tmp_path / "emb.png", batch=16).path)
    _assert_real_picture(draw_network(tncomp.from_eq("ab->a", ("B", 3)),
                                      tmp_path / "one.png").path)


def test_tree_layout_puts_parents_above_and_between_children():
    tree = Tree.from_linear_path(6, [(0, 1), (2, 3), (0, 1), (0, 1), (0, 1)])
    pos = tree_layout(tree)
    assert sorted(pos[k][0] for k in range(6)) == [0, 1, 2, 3, 4, 5]
    assert all(pos[k][1] == 0 for k in range(6))
    for k, (a, b) in enumerate(tree.steps):
        x, y = pos[6 + k]
        assert y == max(pos[a][1], pos[b][1]) + 1
        assert min(pos[a][0], pos[b][0]) < x < max(pos[a][0], pos[b][0])


@pytest.mark.parametrize("name, match", [
    ("net.txt", r"suffix \.txt"),
    ("net", "has no suffix"),
    ("missing-dir/net.png", "does not exist; create it first"),
])
def test_draw_refuses_bad_output_paths(tmp_path, name, match):
    with pytest.raises(PlotError, match=match):
        draw_network(tncomp.from_eq("ab,bc->ac", (3, 4), (4, 5)), tmp_path / name)
    (tmp_path / "adir.png").mkdir()
    with pytest.raises(PlotError, match="is a directory"):
        draw_network(tncomp.from_eq("ab,bc->ac", (3, 4), (4, 5)), tmp_path / "adir.png")


def test_draw_refuses_what_is_not_a_network(tmp_path):
    with pytest.raises(TncompError, match=r"takes a tncomp\.Network .* got str"):
        draw_network("bi,ij->bj", tmp_path / "x.png")


def test_missing_matplotlib_is_one_clear_error(tmp_path, monkeypatch, capsys):
    for mod in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, mod, None)  # import of it now raises ImportError
    needle = r"pip install -e '\.\[plot\]' in the tncomp checkout"
    with pytest.raises(PlotDependencyError, match=needle) as info:
        draw_network(tncomp.from_eq("ab,bc->ac", (3, 4), (4, 5)), tmp_path / "x.png")
    assert isinstance(info.value, ImportError)
    assert main(["plot-costs", TT_SPEC, "-o", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install -e '.[plot]'" in err


# -- plot_costs / cost_curves ------------------------------------------------------------------

def test_cost_curves_of_a_tt_layer_match_formulas_and_the_regimes():
    net = tncomp.tt_linear([3, 5], [2, 7], 3)
    compiled = tncomp.compile(net, disk_cache=False)
    curves = cost_curves(compiled, (1, 4096), model=MODEL)
    b = curves.batches
    assert b[0] == 1 and b[-1] == 4096 and list(b) == sorted(set(b)) and len(b) >= 40
    # dense y = x W with W 15 x 14: forward and two gradient GEMMs of 2 B 15 14 FLOPs each
    for k, batch in enumerate(b):
        gemm_bytes = (batch * 15 + 15 * 14 + batch * 14) * 4
        assert curves.dense.flops[k] == 3 * 2 * batch * 15 * 14
        want = 3 * (max(2 * batch * 15 * 14 / 2e9, gemm_bytes / 1e9) + 5e-6)
        assert curves.dense.times[k] == pytest.approx(want, rel=1e-12)
    # every candidate's FLOPs are cost.py's fwd+bwd formula at that batch
    needs = (True,) * len(net.operands)
    symbolic = problem_for(net)
    for s in curves.candidates:
        total = tree_costs(symbolic, s.tree, needs).total_flops
        formula = sympy.lambdify(sympy.Symbol("B", positive=True, integer=True), total)
        assert list(s.flops) == [int(formula(v)) for v in b], s.label
    # the regime table's plan is the fastest candidate at every batch
    table = compiled.regimes(needs, 4, MODEL)
    assert curves.breakpoints == tuple(x for x in table.breakpoints if x <= 4096)
    assert len(curves.breakpoints) >= 1
    for k, batch in enumerate(b):
        chosen = curves.candidates[curves.chosen_at(batch)]
        assert chosen.tree.signature() == table.tree_for(batch).signature()
        fastest = min(s.times[k] for s in curves.candidates)
        assert chosen.times[k] <= fastest * (1 + 1e-12)
    for bp in curves.breakpoints:
        assert bp in b and bp - 1 in b


def test_cost_curves_of_one_gemm_by_hand():
    net = tncomp.from_eq("bi,ij->bj", ("B", 3), (3, 4))
    curves = cost_curves(net, (2, 100), model=MODEL)
    assert curves.dense is None  # no parameter tensor: no dense equivalent
    (only,) = curves.candidates
    assert list(only.flops) == [3 * 2 * v * 3 * 4 for v in curves.batches]
    forward = cost_curves(net, (2, 100), model=MODEL, needs_grad=(False, False))
    assert list(forward.candidates[0].flops) == [2 * v * 3 * 4 for v in forward.batches]
    x_only = cost_curves(tncomp.tt_linear([3, 5], [2, 7], 3), (1, 64), model=MODEL,
                         needs_grad=(True, False, False, False, False))
    assert list(x_only.dense.flops) == [2 * 2 * v * 15 * 14 for v in x_only.batches]


def test_plot_costs_writes_a_picture_and_returns_the_numbers(tmp_path):
    bounded = tncomp.tt_linear([3, 5], [2, 7], 3, batch=Dim("B", 8, 512))
    curves = plot_costs(bounded, tmp_path / "costs.png", model=MODEL)
    _assert_real_picture(curves.path)
    assert (curves.batches[0], curves.batches[-1]) == (8, 512)  # the symbol's bounds
    assert curves.regimes[0].lo == 8 and curves.regimes[-1].hi == 512


def test_plotted_batches():
    assert plotted_batches(1, 1000, 4) == [1, 10, 100, 1000]
    assert plotted_batches(1, 1000, 4, [57, 2000]) == [1, 10, 56, 57, 100, 1000]
    assert plotted_batches(5, 6, 10) == [5, 6]


@pytest.mark.parametrize("net, batch_range, match", [
    (tncomp.from_eq("ab,bc->ac", (3, 4), (4, 5)), None, "no batch size to sweep"),
    (tncomp.from_eq("ab,bc->ac", ("B", 4), (4, "C")), None, r"2 symbolic sizes \(B, C\)"),
    (tncomp.from_eq("ab,bc->ac", ("B", 4), (4, 5)), (5, 3), "is empty"),
    (tncomp.from_eq("ab,bc->ac", ("B", 4), (4, 5)), (0, 3), "outside its bounds"),
    (tncomp.from_eq("ab,bc->ac", ("B", 4), (4, 5)), (1.0, 3), "two ints"),
    (tncomp.from_eq("ab,bc->ac", ("B", 4), (4, 5)), (1, 2, 3), "two ints"),
    (tncomp.from_eq("ab,bc->ac", (Dim("B", 4, 4), 4), (4, 5)), None, "fixed at 4"),
])
def test_cost_curves_refuse_what_cannot_be_swept(net, batch_range, match):
    with pytest.raises(SizeError, match=match):
        cost_curves(net, batch_range, name="SPEC 'x'")


def test_cost_curves_refuse_bad_options():
    net = tncomp.from_eq("ab,bc->ac", ("B", 4), (4, 5))
    with pytest.raises(TncompError, match="points=1"):
        cost_curves(net, points=1)
    with pytest.raises(TncompError, match="needs_grad has 1 entries for 2"):
        cost_curves(net, needs_grad=(True,))
    with pytest.raises(TncompError, match=r"pass a tncomp\.DeviceModel"):
        cost_curves(net, model="cpu")


# -- the command line, in-process -------------------------------------------------------------

def test_cli_draw(tmp_path, capsys):
    assert main(["draw", TT_SPEC, "-o", str(tmp_path / "net.png"), "--batch", "32"]) == 0
    assert "wrote" in capsys.readouterr().out
    _assert_real_picture(tmp_path / "net.png")


def test_cli_plot_costs(tmp_path, capsys):
    assert main(["plot-costs", TT_SPEC, "-o", str(tmp_path / "costs.png"),
                 "--batch-range", "1", "2048"]) == 0
    out = capsys.readouterr().out
    assert "candidate plans over B=1..2048" in out
    _assert_real_picture(tmp_path / "costs.png")


@pytest.mark.parametrize("argv, words", [
    (["plot-costs", "eq:ab,bc->ac:3,4|4,5"], ["SPEC 'eq:ab,bc->ac:3,4|4,5'",
                                              "no batch size to sweep"]),
    (["draw", "tt:15x14:modes=3,5|2|7"], ["not a comma-separated list"]),
    (["draw", "tt:15x14:modes=3,4|2,7"], ["modes multiply to 12x14"]),
    (["draw", "eq:ab,bc->ac:3,4|4"], ["has 2 indices but shape (4,) has 1 axes"]),
    (["draw", "eq:a->a:²"], ["not an identifier"]),
    (["draw", "nothing:here"], ["is not understood"]),
    (["draw", "missing.json"], ["does not exist"]),
    (["plot-costs", TT_SPEC, "--batch-range", "9", "3"], ["is empty"]),
    (["draw", TT_SPEC, "--batch", "0"], ["outside its bounds"]),
    (["plot-costs", TT_SPEC, "--device", "gpu0"], ["--device 'gpu0' is not a torch device"]),
])
def test_cli_errors_are_one_line_exit_2(tmp_path, capsys, argv, words):
    argv = [*argv, "-o", str(tmp_path / "x.png")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tncomp: error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err
    assert not (tmp_path / "x.png").exists()


def test_cli_bad_output_fails_before_compiling(tmp_path, capsys):
    assert main(["draw", TT_SPEC, "-o", str(tmp_path / "net.bmpx")]) == 2
    assert "suffix .bmpx" in capsys.readouterr().err


# -- the command line, in a subprocess --------------------------------------------------------

def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "tncomp.cli", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


@pytest.mark.slow  # a fresh interpreter importing torch: several seconds
def test_subprocess_malformed_spec_exits_2_with_one_line(tmp_path):
    done = _cli("draw", "tt:768x3072:modes=12,8|12,16,16:rank=30", "-o", "net.png",
                cwd=tmp_path)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("tncomp: error: SPEC") and "multiply to 96x3072" in done.stderr


@pytest.mark.slow
def test_subprocess_draw_and_plot_costs_write_pictures(tmp_path):
    spec = "tt:768x3072:modes=12,8,8|12,16,16:rank=30"
    done = _cli("draw", spec, "-o", "net.png", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    _assert_real_picture(tmp_path / "net.png")
    done = _cli("plot-costs", spec, "-o", "costs.png", "--batch-range", "1", "65536",
                cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "breakpoints" in done.stdout
    _assert_real_picture(tmp_path / "costs.png")


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ("plot-costs", "eq:ab,bc->ac:3,4|4,5", "-o", "c.png"),
    ("draw", "eq:bi,ij->bj:B,3|4,5", "-o", "n.png"),
    ("draw", "ttm:16x16:modes=4,4|4,4:rank=0", "-o", "n.png"),
])
def test_subprocess_bad_input_exits_2_without_traceback(tmp_path, args):
    done = _cli(*args, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("tncomp: error: ") and done.stderr.count("\n") == 1
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_subprocess_without_matplotlib(tmp_path):
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv[0] = 'tncomp'; "
            "runpy.run_module('tncomp.cli', run_name='__main__')")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code, "draw", TT_SPEC, "-o", "n.png"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "pip install -e '.[plot]'" in done.stderr


def test_a_picture_replaces_a_planted_link_instead_of_writing_through_it(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("DATA")
    out = tmp_path / "net.png"
    out.symlink_to(victim)
    draw_network(tncomp.tt_linear((4, 4), (4, 4), 2), out)
    assert victim.read_text() == "DATA"
    assert not out.is_symlink() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
