"""`comera convert --set format=...` takes any registered format, or a {pattern: format}
mapping; `comera report` shows each layer's format. Run in process (cli.main)."""

from __future__ import annotations

import json

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
