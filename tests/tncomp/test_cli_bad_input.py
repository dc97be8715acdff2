"""The ``tncomp`` command keeps its promise on bad input: exit 2, one line, nothing written.

Each case of issue 11 gave a traceback with exit 1 (``calibrate --device cuda`` without CUDA)
or went through silently (``plot-costs --device cuda`` there, unknown SPEC keys, a rank above
the layer's full rank). The subprocess test runs the real entry point (one case by default,
all with ``-m slow``: each process imports torch); the in-process tests run every case.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

from tests.helpers import ROOT
from tncomp.cli import RankClipWarning, main, parse_spec
from tncomp.errors import SpecError

NO_CUDA = not torch.cuda.is_available()
SPEC = "tt:6x6:modes=2,3|3,2:rank=2"

# (argv, words the one line must hold, runs without CUDA only); "{out}" is a file to not write.
BAD = {
    "calibrate-cuda": (["calibrate", "--device", "cuda"], "CUDA is not available", True),
    "calibrate-meta": (["calibrate", "--device", "meta"], "plans for cpu and cuda", False),
    "plot-costs-cuda": (["plot-costs", SPEC, "-o", "{out}", "--device", "cuda"],
                        "CUDA is not available", True),
    "unknown-key": (["inspect", f"{SPEC}:foo=1"], "unknown key 'foo'; the keys are modes, rank",
                    False),
    "unknown-key-draw": (["draw", f"{SPEC}:foo=1", "-o", "{out}"], "unknown key 'foo'", False),
    "field-without-value": (["inspect", "tt:6x6:modes=2,3|3,2:rank"], "KEY=VALUE", False),
    "key-twice": (["inspect", f"{SPEC}:rank=3"], "gives rank= twice", False),
    "memory-unknown": (["inspect", SPEC, "--memory", "low"], "memory='low'; choose one of",
                       False),
    "memory-plot-negative": (["plot-costs", SPEC, "-o", "{out}", "--memory", "-5"],
                             "memory='-5'", False),
    # issue 42, item 7: --threads (argparse's int would print usage and two lines)
    "calibrate-threads-zero": (["calibrate", "--threads", "0"],
                               "--threads=0; give a number of threads from 1 to", False),
    "calibrate-threads-word": (["calibrate", "--threads", "two"], "--threads='two'", False),
    "calibrate-threads-negative": (["calibrate", "--threads", "-1"], "--threads='-1'", False),
    "inspect-threads-too-many": (["inspect", SPEC, "--measure", "--threads", "100000"],
                                 "--threads=100000; give a number of threads from 1 to", False),
    "inspect-threads-without-measure": (["inspect", SPEC, "--threads", "1"],
                                        "--threads 1 sets the threads --measure runs on",
                                        False),
    "spec-json-nested-deep": (["inspect", "{deep}"], "nests its JSON too deep", False),
}
SUBPROCESS_DEFAULT = ("calibrate-cuda",)


def _argv(case: str, out, inputs) -> list[str]:
    argv, _, needs_no_cuda = BAD[case]
    if needs_no_cuda and not NO_CUDA:
        pytest.skip("this machine has CUDA")
    if "{deep}" in argv:  # a SPEC file nested 100,000 deep (a RecursionError on main)
        inputs.mkdir(exist_ok=True)
        deep = inputs / "deep.json"
        deep.write_text("[" * 100_000 + "]" * 100_000)
        argv = [str(deep) if a == "{deep}" else a for a in argv]
    return [a.replace("{out}", str(out)) for a in argv]


def _params(default: tuple[str, ...] = tuple(BAD)):
    for case in BAD:
        marks = [] if case in default else [pytest.mark.slow]
        yield pytest.param(case, id=case, marks=marks)


@pytest.mark.parametrize("case", list(_params(SUBPROCESS_DEFAULT)))
def test_bad_input_in_a_subprocess(case, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    argv = _argv(case, work / "picture.png", tmp_path / "inputs")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TNCOMP_CACHE_DIR": str(work / "cache")}
    proc = subprocess.run([sys.executable, "-m", "tncomp.cli", *argv], capture_output=True,
                          text=True, timeout=300, cwd=work, env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tncomp: error: "), proc.stderr
    assert BAD[case][1] in lines[0]
    assert list(work.iterdir()) == [], "nothing is written on bad input"


@pytest.mark.parametrize("case", list(_params()))
def test_bad_input_in_process(case, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TNCOMP_CACHE_DIR", str(tmp_path / "cache"))
    argv = _argv(case, tmp_path / "picture.png", tmp_path / "inputs")
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tncomp: error: "), err
    assert BAD[case][1] in lines[0]
    assert [p.name for p in tmp_path.iterdir() if p.name != "inputs"] == []


def test_rank_above_full_rank_warns_in_one_line(capsys):
    # Bonds (1, 2, 6, 2, 1) at full rank: 80 parameters, more than the dense 6x6.
    code = main(["inspect", "tt:6x6:modes=2,3|3,2:rank=100", "--batch", "4"])
    out, err = capsys.readouterr()
    assert code == 0 and "gemm" in out
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tncomp: warning: "), err
    assert "rank=100 is above the layer's full TT rank 6" in lines[0]
    assert "80 parameters against 36 dense" in lines[0]


def test_rank_warning_is_a_python_warning_for_library_users():
    with pytest.warns(RankClipWarning, match=r"rank=100000 .* full TT rank 144"):
        net = parse_spec("ttm:768x3072:modes=12,8,8|12,16,16:rank=100000")
    bonds = [net.shape(t)[0] for t in net.operands[1:]]
    assert bonds == [1, 144, 128]  # each bond clipped to what it can reach (full rank 144)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ranks at or below full rank, lists: no warning
        parse_spec("tt:768x3072:modes=12,8,8|12,16,16:rank=30")
        parse_spec("tt:768x3072:modes=12,8,8|12,16,16:rank=768")
        parse_spec("tt:6x6:modes=2,3|3,2:rank=2,3,2")


def test_json_spec_keys_are_checked(tmp_path):
    spec = tmp_path / "net.json"
    spec.write_text('{"tt": {"in_modes": [2, 3], "out_modes": [3, 2], "ranks": 2, "rnak": 3}}')
    with pytest.raises(SpecError, match="entry 'tt' has unknown key 'rnak'"):
        parse_spec(str(spec))
    spec.write_text('{"eq": "ij->j", "shapes": [[2, 3]], "ranks": 3}')
    with pytest.raises(SpecError, match="unknown key 'ranks' beside 'eq'"):
        parse_spec(str(spec))
    spec.write_text('{"tt": {"in_modes": [2, 3], "out_modes": [3, 2], "ranks": 99}}')
    with pytest.warns(RankClipWarning, match="rank=99"):
        parse_spec(str(spec))



def test_a_reader_that_stops_reading_ends_the_command_quietly(tmp_path):
    """``tncomp inspect SPEC | head`` printed a BrokenPipeError traceback (issue 34, item 12):
    the pipe is closed before the report is written, as ``| head -0`` does."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TNCOMP_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "tncomp.cli", "inspect", SPEC],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path, env=env)
    proc.stdout.close()  # the reader is gone before the first byte
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=300) == 0, stderr
    assert stderr == ""
