"""benchmarks/studies/lm_clock.py: every frontier model timed side by side, with its step's
peak memory and its counted FLOPs (the equal-time frontier's clock)."""

from __future__ import annotations

import json

import pytest

from benchmarks.studies import lm_clock
from tests.helpers.tiny_corpus import write_tiny_corpus


def _corpus(tmp_path):
    """A tiny corpus written under ``tmp_path``: the smoke clock's data."""
    root = tmp_path / "corpus"
    root.mkdir()
    write_tiny_corpus(root)
    return root

def test_the_clock_times_every_model_and_counts_its_flops_and_memory(tmp_path):
    root = _corpus(tmp_path)
    out = tmp_path / "clock"
    assert lm_clock.main(["--smoke", "--root", str(root), "--threads", "1", "--widths", "8",
                          "--out", str(out)]) == 0
    payload = json.loads(out.with_suffix(".json").read_text())
    results = payload["results"]
    assert {"dense", "dense@8", "narrow 2x", "tt 2x", "lowrank 2x", "cola 2x"} <= results.keys()
    # CoLA at the low-rank rank: the same parameters, one activation more per bottleneck
    assert results["cola 2x"]["params"] == results["lowrank 2x"]["params"]
    assert results["dense@8"]["gflops"] < results["dense"]["gflops"]  # d_model 8, FFN 32
    tokens = payload["batch"] * (payload["seq_len"] - 1)
    d, f = 16, 64  # the smoke model: one block, d_model 16, FFN 64
    block = 4 * d * d + 2 * d * f
    # forward 2, backward 4 FLOPs per weight and token: the block layers alone bound it below
    assert results["dense"]["gflops"] * 1e9 >= 6 * tokens * block
    assert results["narrow 2x"]["gflops"] < results["dense"]["gflops"]
    for r in results.values():
        assert r["ms"] > 0 and r["peak_mib"] > 0
        assert r["peak_mib"] * 2**20 > 4 * r["params"]  # at least the float32 parameters
    assert "GFLOPs per step" in out.with_suffix(".md").read_text()


def test_a_width_the_model_cannot_take_exits_2_before_any_data(tmp_path, capsys):
    out = tmp_path / "clock"
    with pytest.raises(SystemExit) as exit_info:
        lm_clock.main(["--widths", "96", "90", "--root", str(tmp_path / "none"), "--out",
                       str(out)])
    assert exit_info.value.code == 2
    assert "width 90: a d_model is a positive multiple of the 4 heads" in capsys.readouterr().err
    assert not out.with_suffix(".json").exists()


def test_format_methods_with_options_are_timed_beside_their_format(tmp_path):
    root = _corpus(tmp_path)
    out = tmp_path / "clock"
    assert lm_clock.main(["--smoke", "--root", str(root), "--threads", "1", "--only", "btt",
                          "--methods", "btt+rms:balanced", "btt+zero", "--out", str(out)]) == 0
    results = json.loads(out.with_suffix(".json").read_text())["results"]
    assert set(results) == {"dense", "narrow 2x", "btt 2x", "btt+rms 2x", "btt+zero 2x"}
    # the same layers: an option changes what a step does, not what the model holds
    assert results["btt+rms 2x"]["params"] == results["btt 2x"]["params"]


@pytest.mark.parametrize(("flags", "says"), [
    (["--methods", "btt"], "give a format with options"),
    (["--methods", "btt+bogus"], "method option 'bogus'"),
    (["--only", "einsum"], "invalid choice")])
def test_bad_methods_exit_2_before_any_data(flags, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        lm_clock.main([*flags, "--root", str(tmp_path / "none"), "--out", str(tmp_path / "c")])
    assert exit_info.value.code == 2 and says in capsys.readouterr().err
