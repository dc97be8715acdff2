"""`comera convert --set format=...` takes any registered format, or a {pattern: format}
mapping; `comera report` shows each layer's format. Run in process (cli.main)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import comera
from comera import cli
from comera.formats.registry import format_names, get_format, table_formats


def _model_file(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "model.pt"
    torch.save(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)), path)
    return path


def test_convert_takes_a_format_per_pattern_and_report_shows_it(tmp_path, capsys):
    out = tmp_path / "tt.pt"
    mapping = json.dumps({"0": "ttm", "*": "tt"})
    assert cli.main(["convert", str(_model_file(tmp_path)), "-o", str(out), "--set", "ranks=2",
                     "--set", f"format={mapping}"]) == 0
    assert cli.main(["report", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(k for k, line in enumerate(lines) if line.startswith("layer "))
    assert lines[head].split()[:3] == ["layer", "type", "format"]
    rows = {line.split()[0]: line.split()[1:3] for line in lines[head + 2:]
            if line.split() and line.split()[0] in {"0", "2"}}
    assert rows == {"0": ["TTMLinear", "ttm"], "2": ["TTLinear", "tt"]}


def test_an_unknown_format_is_one_line_naming_the_choices(tmp_path, capsys):
    out = tmp_path / "tt.pt"
    assert cli.main(["convert", str(_model_file(tmp_path)), "-o", str(out), "--set",
                     "format=tuker"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    convertible = [n for n in format_names() if get_format(n).from_modes]
    assert "format='tuker'" in err and ", ".join(convertible) in err
    assert not out.exists()


class _Lookup(nn.Module):
    """A table and a head: what `comera convert --set embedding=true` converts."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(30, 12, padding_idx=0)
        self.head = nn.Linear(12, 4)

    def forward(self, ids):
        return self.head(self.table(ids))


def test_convert_saves_tables_of_every_table_format(tmp_path, capsys):
    """A table converted to any format that holds one is saved (it used to be refused unless
    TT-matrix) and loads into the original architecture with every saved tensor."""
    torch.manual_seed(0)
    source = tmp_path / "model.pt"
    torch.save(_Lookup(), source)
    ids = torch.tensor([[0, 3, 29], [7, 7, 1]])
    for fmt in table_formats():
        out = tmp_path / f"{fmt}.pt"
        code = cli.main(["convert", str(source), "-o", str(out), "--set", f"format={fmt}",
                         "--set", "embedding=true", "--set", "ranks=3", "--set", "d=2"])
        assert code == 0, capsys.readouterr().err
        loaded = _Lookup()
        comera.load_checkpoint(out, loaded)
        table = loaded.table
        assert isinstance(table, comera.GatedEmbedding) and table.padding_idx == 0
        assert table.format.name == get_format(fmt).table_format
        saved = comera.read_checkpoint(out).model
        assert saved.keys() == loaded.state_dict().keys()
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in saved.items())
        assert loaded(ids).shape == (2, 3, 4) and not loaded.table(ids)[0, 0].any()
        capsys.readouterr()
        assert cli.main(["report", str(out)]) == 0
        rows = [line.split()[:3] for line in capsys.readouterr().out.splitlines()]
        assert ["table", type(table).__name__, table.format.name] in rows


# -- comera train --format ------------------------------------------------------------------------
def _toy_experiment(monkeypatch, recommended: str | None = None) -> None:
    """A registered experiment on the toy task (tests/helpers/toy_task.py): a few steps; its
    task recommends ``recommended`` (None: the Task default)."""
    from comera.experiments import registry
    from comera.experiments.engine import EngineConfig
    from tests.helpers.toy_task import ToyTask

    def make_task(quick: bool) -> ToyTask:
        task = ToyTask()
        if recommended is not None:
            task.recommended_format = recommended
        return task

    quick = EngineConfig(steps_early=3, steps_late=2, batch_size=16, eval_every=2,
                         target_compression=1.5, threads=1)
    monkeypatch.setitem(registry.EXPERIMENTS, "toy", registry.Experiment(
        "toy", "regression onto a low-rank teacher", make_task, quick, quick))


def test_train_format_builds_the_comera_run_in_that_format(tmp_path, monkeypatch, capsys):
    _toy_experiment(monkeypatch)
    monkeypatch.setenv("COMERA_NO_PROGRESS", "1")
    out = tmp_path / "run"
    assert cli.main(["train", "toy", "--quick", "--format", "tucker", "--out", str(out)]) == 0
    summary = json.loads((out / "toy.json").read_text())
    assert summary["config"]["format"] == "tucker"
    comera_ckpt = comera.read_checkpoint(out / "checkpoints" / "comera.pt")
    assert [s["format"] for s in comera_ckpt.layers.values()] == ["tucker"]
    assert comera.read_checkpoint(out / "checkpoints" / "dense.pt").layers == {}  # stays dense
    capsys.readouterr()
    # resuming under another format is refused, naming the formats and the fix; nothing trains
    before = (out / "toy.json").read_text()
    code = cli.main(["train", "toy", "--quick", "--resume", "--format", "ttm", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "(format 'tucker'), not 'toy' (format 'ttm')" in err and "--format tucker" in err
    assert (out / "toy.json").read_text() == before
    # resuming with no --format continues the run in its own format, not the task's default
    assert cli.main(["train", "toy", "--quick", "--resume", "--out", str(out)]) == 0
    assert json.loads((out / "toy.json").read_text())["config"]["format"] == "tucker"


def test_train_format_defaults_to_the_tasks_recommended_format(tmp_path, monkeypatch):
    _toy_experiment(monkeypatch, recommended="tucker")
    monkeypatch.setenv("COMERA_NO_PROGRESS", "1")
    assert cli.main(["train", "toy", "--quick", "--variants", "comera", "--out",
                     str(tmp_path / "a")]) == 0
    assert json.loads((tmp_path / "a" / "toy.json").read_text())["config"]["format"] == "tucker"
    _toy_experiment(monkeypatch)  # a task that names none: the format of fresh layers
    assert cli.main(["train", "toy", "--quick", "--variants", "comera", "--out",
                     str(tmp_path / "b")]) == 0
    layers = comera.read_checkpoint(tmp_path / "b" / "checkpoints" / "comera.pt").layers
    assert [s["format"] for s in layers.values()] == ["ttm"]


def test_train_format_help_names_each_tasks_recommended_format_and_the_registry():
    from comera.experiments.dlrm_task import DLRMTask
    from comera.experiments.lm_task import LMTask
    from comera.experiments.mlm_task import MLMTask
    from comera.experiments.pair_task import CodePairTask
    from comera.experiments.registry import EXPERIMENTS
    from comera.experiments.transformer_task import ReviewsTask
    from comera.formats.registry import layer_formats

    assert cli.build_parser().parse_args(["train", "dlrm"]).format is None  # the task's
    tasks = {"lm": LMTask, "mlm": MLMTask, "dlrm": DLRMTask, "transformer": ReviewsTask,
             "transformer-code": CodePairTask}
    assert set(tasks) == set(EXPERIMENTS)
    # each task's choice without its data (a classifier's property reads no pretrained encoder)
    recommended = {name: task.__new__(task).recommended_format for name, task in tasks.items()}
    assert recommended == {"lm": "ttm", "mlm": "ttm", "dlrm": "tt", "transformer": "tt",
                           "transformer-code": "tt"}
    by_format: dict[str, list[str]] = {}
    for name, format in recommended.items():
        by_format.setdefault(format, []).append(name)
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    text = " ".join(sub.choices["train"].format_help().split())
    assert "--format {" + ",".join(f for f in layer_formats() if f != "dense") + "}" in text
    for format, names in by_format.items():
        listed = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
        assert f"{format} for {listed}" in text, (format, listed)


@pytest.mark.parametrize("value", ["tuker", "dense", "einsum", ""])
def test_a_bad_train_format_exits_2_naming_the_choices(tmp_path, capsys, value):
    out = tmp_path / "run"
    try:
        code = cli.main(["train", "dlrm", "--quick", "--format", value, "--out", str(out)])
    except SystemExit as exc:  # argparse refuses a value outside the choices
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--format" in err and all(f"'{f}'" in err for f in format_names()
                                     if get_format(f).from_modes)
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_train_dlrm_with_tables_of_another_format(tmp_path, monkeypatch):
    """The quick DLRM with Tucker tables: trains, saves its tables in their format (refused
    before GatedEmbedding records existed) and reports them."""
    monkeypatch.setenv("COMERA_NO_PROGRESS", "1")
    monkeypatch.setenv("COMERA_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert cli.main(["train", "dlrm", "--quick", "--format", "tucker", "--steps", "2",
                     "--late-steps", "1", "--eval-every", "1", "--variants", "comera",
                     "--threads", "1", "--out", str(out)]) == 0
    layers = comera.read_checkpoint(out / "checkpoints" / "comera.pt").layers
    assert layers and {(s["kind"], s["format"]) for s in layers.values()} == {
        ("GatedEmbedding", "tucker")}
