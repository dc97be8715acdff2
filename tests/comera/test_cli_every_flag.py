"""Every ``comera`` flag, read from the argparse parser (so a new flag must be listed here),
with bad values: negative, 0 where invalid, nan, inf, huge, wrong type, empty. Each gives exit
2 and one line on stderr naming the flag, before anything is built, trained or written
(issue 26, item 4). In-process: a guard fails the test if the training would start."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import comera.experiments.distributed as distributed
from comera.cli import build_parser, main
from tests.helpers import ROOT

INT = ["-1", "abc", "1.5", "", "nan", "1" + "0" * 30]  # huge: beyond int64
FLOAT = ["nan", "inf", "-inf", "-1", "abc", "", "1e400"]
ZERO_INVALID = {"--batch-size", "--eval-every", "--lr", "--lr-gates", "--target-compression",
                "--nproc", "--steps"}
SWITCHES = {"--quick", "--resume", "--compile", "--checkpoint-blocks", "--fsdp", "--no-progress",
            "--verbose", "-v", "--force"}  # flags without a value

# (command, flag) -> bad values for flags whose type alone does not say what is bad;
# "{tmp}" / "{file}" are a folder and a file that exist
BY_FLAG: dict[tuple[str, str], list[str]] = {
    ("train", "model"): ["bogus", ""],
    ("train", "--device"): ["", "bogus", "tpu", "cuda:99999"],
    ("train", "--out"): ["", "{file}"],
    ("train", "--variants"): ["", ",", "sparse", "dense,dense"],
    ("train", "--late-landing"): [*FLOAT, "0", "1.5"],  # a fraction in (0, 1]
    ("train", "--init-from"): ["", "{tmp}/missing.pt", "{tmp}", "{file}"],  # {file}: text
    ("convert", "model"): ["", "{tmp}/missing.pt", "{tmp}", "{file}"],
    ("convert", "--output"): ["", "{tmp}", "{tmp}/missing/x.pt", "{file}", "{model}"],
    ("convert", "--config"): ["[1]", "", "null", '"x"', "{", '{"ranks": NaN}', "{tmp}",
                              '{"ranks": "16"}', '{"bogus": 1}'],
    ("convert", "--set"): ["x", "=1", "bogus=1", "ranks=abc", "ranks=NaN", "ranks=1e999",
                           "target_compression=Infinity"],
    ("convert", "--calibration"): ["", "{tmp}/missing.pt", "{tmp}", "{file}", "{model}"],
    ("convert", "--measure"): ["", "{tmp}/missing.pt", "{tmp}", "{file}", "{model}"],
    ("report", "checkpoint"): ["", "{tmp}/missing.pt", "{tmp}", "{file}"],
}


def _flags() -> list[tuple[str, str, argparse.Action]]:
    """(command, flag or positional name, action) of every argument of every subcommand."""
    parser = build_parser()
    found = [("", a.option_strings[-1], a) for a in parser._actions
             if a.option_strings and not isinstance(a, argparse._HelpAction)]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command, subparser in sub.choices.items():
        for action in subparser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            name = action.option_strings[-1] if action.option_strings else action.dest
            found.append((command, name, action))
    return found


ALIASES = {(c, f): tuple(a.option_strings) for c, f, a in _flags() if a.option_strings}


def _bad_values(command: str, flag: str, action: argparse.Action) -> list[str]:
    if (command, flag) in BY_FLAG:
        return BY_FLAG[(command, flag)]
    if action.choices:
        return ["bogus", ""]
    values = {int: INT, float: FLOAT}.get(action.type)
    if values is None:
        raise AssertionError(f"comera {command} {flag}: list its bad values in BY_FLAG")
    return values + (["0"] if flag in ZERO_INVALID else [])


def _cases():
    cases = []
    for command, flag, action in _flags():
        if action.nargs == 0:  # a switch: nothing to give it
            assert flag in SWITCHES, f"comera {command} {flag}: a new switch; list it"
            continue
        for value in _bad_values(command, flag, action):
            cases.append(pytest.param(command, flag, value, id=f"{command}{flag}={value!r}"))
    return cases


def test_every_valued_flag_has_cases():
    covered = {(c.values[0], c.values[1]) for c in _cases()}
    valued = {(c, f) for c, f, a in _flags() if a.nargs != 0}
    assert covered == valued and len(valued) > 25


class _WorkStarted(Exception):
    pass


@pytest.fixture
def no_work(monkeypatch):
    """Fail at the first step past the checks: the workers' start, which precedes building
    the task's data and model."""
    def refuse(*args, **kwargs):
        raise _WorkStarted("the checks passed a bad value; training would start")

    monkeypatch.setattr(distributed, "init_from_env", refuse)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "model.pt"
    torch.save(nn.Sequential(nn.Linear(8, 8)), path)
    return path


def _argv(command: str, flag: str, value: str, tmp: Path, model: Path) -> list[str]:
    out = str(tmp / "run")
    if command == "train":
        base = {"model": "dlrm", "--out": out}
        if flag == "--init-from":
            base["model"] = "transformer"
        base[flag] = value
        argv = ["train", base.pop("model"), "--quick"]
    elif command == "convert":
        base = {"model": str(model), "--output": str(tmp / "o.pt")}
        base[flag] = value
        argv = ["convert", base.pop("model")]
    else:
        return ["report", value]
    for key, given in base.items():
        argv += [key, given]
    return argv


@pytest.mark.parametrize("command, flag, value", _cases())
def test_a_bad_value_exits_2_with_one_line_before_any_work(tmp_path, capsys, no_work,
                                                           model_file, command, flag, value):
    (tmp_path / "file.txt").write_text("not a directory")
    value = value.replace("{tmp}", str(tmp_path)).replace("{file}", str(tmp_path / "file.txt"))
    value = value.replace("{model}", str(model_file))
    before = sorted(p.name for p in tmp_path.iterdir())
    argv = _argv(command, flag, value, tmp_path, model_file)
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse refuses wrong types and choices itself
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, (argv, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error: " in lines[0], err
    assert "Traceback" not in err
    names = ALIASES.get((command, flag), (flag,))
    if flag.startswith("-") or value:
        assert (any(n in err for n in names) or flag.lstrip("-").replace("-", "_") in err
                or (value and value in err)
                or (flag in ("--config", "--set") and "convert setting" in err)), (flag, value, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "a refused command wrote"


@pytest.mark.parametrize("args, needle", [
    (["--lam", "inf"], "lam=inf"), (["--lam", "-1"], "lam=-1"), (["--lam", "nan"], "lam=nan"),
    (["--seed", "100000000000000000000000"], "seed=100000000000000000000000"),
    (["--fsdp"], "fsdp=True with 1 worker"),  # FSDP shards over 2 or more workers
    (["--late-allocation", "spectrum", "--format", "tucker"], "tensor-train chains"),
])
def test_the_issue_reproductions_exit_2_up_front(tmp_path, capsys, no_work, args, needle):
    code = main(["train", "dlrm", "--quick", "--variants", "dense,comera", "--out",
                 str(tmp_path / "out"), *args])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and args[0] in err, err
    assert not (tmp_path / "out").exists()


def test_the_late_stage_flags_reach_the_engine_config():
    from comera.cli import _engine_config
    from comera.experiments.registry import EXPERIMENTS

    args = build_parser().parse_args(["train", "lm", "--quick", "--late-allocation", "spectrum",
                                      "--late-landing", "0.5"])
    config = _engine_config(args, EXPERIMENTS["lm"])
    assert (config.late_allocation, config.late_landing) == ("spectrum", 0.5)
    plain = _engine_config(build_parser().parse_args(["train", "lm", "--quick"]),
                           EXPERIMENTS["lm"])
    assert (plain.late_allocation, plain.late_landing) == ("auto", 0.75)
    from comera.ranks.objective import ALLOCATIONS  # the CLI lists them without importing

    choices = next(a.choices for c, f, a in _flags() if f == "--late-allocation")
    assert set(choices) == {"auto", *ALLOCATIONS}


def test_convert_config_that_is_not_an_object_is_one_line(tmp_path, capsys, model_file):
    code = main(["convert", str(model_file), "-o", str(tmp_path / "x.pt"), "--config", "[1]"])
    err = capsys.readouterr().err
    assert code == 2 and "not a JSON object" in err and "[1]" in err, err


@pytest.mark.slow
def test_an_unreachable_target_compression_exits_2_before_training(tmp_path):
    env = {"PYTHONPATH": str(ROOT), "COMERA_CACHE_DIR": str(tmp_path / "cache"),
           "COMERA_NO_PROGRESS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "comera.cli", "train", "dlrm", "--quick",
                           "--target-compression", "1e308", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 2, done.stderr
    assert "target_compression=1e+308 cannot be reached" in done.stderr
    assert "--target-compression" in done.stderr
    assert not (tmp_path / "out").exists()

