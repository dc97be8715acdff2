"""`comera convert --set format=...` takes any registered format, or a {pattern: format}
mapping; `comera report` shows each layer's format. Run in process (cli.main)."""

from __future__ import annotations

import json

import torch
from torch import nn

from comera import cli
from comera.formats.registry import format_names, get_format


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
