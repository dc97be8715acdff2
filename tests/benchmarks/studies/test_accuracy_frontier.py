"""The four-way frontier script's pieces that need no training: sizes of the linear layers per
method, the table (mean ± sd per method and target, the ranks chosen next to the uniform ones)
and the plot."""

from __future__ import annotations

import statistics

import pytest
from torch import nn

from benchmarks.studies.accuracy_frontier import linear_sizes, main, plot, summarise
from comera import TTLinear
from comera.layers.lowrank import LowRankLinear


class _Blocks(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.blocks = nn.ModuleList([nn.ModuleDict({"ffn": layer})])
        self.head = nn.Linear(32, 2)  # not a compressed layer: never counted


def test_linear_sizes_count_the_compressed_layers_of_each_kind():
    dense = _Blocks(nn.Linear(32, 16))
    assert linear_sizes(dense) == (32 * 16 + 16, 32 * 16 + 16)
    low = _Blocks(LowRankLinear(32, 16, 3))
    assert linear_sizes(low) == (3 * 48 + 16, 32 * 16 + 16)
    tt = _Blocks(TTLinear(32, 16, (4, 8), (4, 4), ranks=2))
    assert linear_sizes(tt) == (4 * 2 + 2 * 8 * 2 + 2 * 4 * 2 + 2 * 4 + 16, 32 * 16 + 16)


def _result():
    rows = []
    for seed, shift in ((0, 0.0), (1, 0.01), (2, 0.02)):
        rows.append({"seed": seed, "model": "dense", "target": None,
                     "test": {"accuracy": 0.85 + shift}})
        for target in (10.0, 100.0):
            rows.append({"seed": seed, "model": "fixed", "target": target, "rank": 4,
                         "test": {"accuracy": 0.84 + shift}, "linear_compression": target * 1.1,
                         "ranks": {"blocks.0.q": [1, 4, 4, 1]}})
            rows.append({"seed": seed, "model": "comera", "target": target, "uniform_rank": 4,
                         "test": {"accuracy": 0.86 + shift}, "linear_compression": target,
                         "ranks": {"blocks.0.attn.q": [1, 4, 6, 1]}})
        rows.append({"seed": seed, "model": "lowrank", "target": 10.0, "rank": 8,
                     "test": {"accuracy": 0.83 + shift}, "linear_compression": 10.5,
                     "ranks": {"blocks.0.q": [8]}})
    return {"data": {"train": 10, "val": 2, "test": 2, "majority_test": 0.8}, "rows": rows}


def test_summary_gives_mean_and_spread_per_method_and_the_ranks_chosen():
    text = summarise(_result())
    sd = statistics.stdev([0.0, 0.01, 0.02])
    assert f"Dense: 0.8600 ± {sd:.4f} (n=3)" in text
    lines = {line.split(" |")[0]: line for line in text.splitlines() if line.startswith("| 1")}
    assert lines["| 10x"] == (f"| 10x | 0.8500 ± {sd:.4f} (n=3; 11.0x, rank 4) | 0.8400 ± "
                              f"{sd:.4f} (n=3; 10.5x, rank 8) | 0.8700 ± {sd:.4f} (n=3; 10.0x) |")
    assert lines["| 100x"].split(" | ")[2] == "-"  # no low-rank row, no plan saying why
    planned = _result() | {"plan": {"lowrank": {"10.0": 8, "100.0": 0}}}
    lines = {line.split(" |")[0]: line for line in summarise(planned).splitlines()
             if line.startswith("| 1")}
    assert lines["| 100x"].split(" | ")[2] == "none fits: rank 1 is over the budget"
    assert "- 100x (uniform rank 4): b0.q [4, 6]" in text
    assert "- 10x: 0.0200 ± 0.0000 (n=3; seeds +0.0200, +0.0200, +0.0200)" in text  # paired


def test_summarise_only_writes_table_and_plot(tmp_path):
    import json

    (tmp_path / "frontier.json").write_text(json.dumps(_result()))
    assert main(["--summarise-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "frontier.md").read_text().startswith("Reviews task")
    assert (tmp_path / "frontier.png").stat().st_size > 1000
    plot(_result(), tmp_path / "again.png")


@pytest.mark.parametrize("flags", [["--early-landing", "0"], ["--early-landing", "1.5"],
                                   ["--threads", "0"]])
def test_bad_flags_exit_2_before_any_training(flags, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main([*flags, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert not (tmp_path / "out").exists()
