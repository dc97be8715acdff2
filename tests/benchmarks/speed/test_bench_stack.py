"""The stack benchmark's quick mode: every variant runs a finite training step, results written."""

from __future__ import annotations

import json
import math

import pytest


@pytest.mark.slow
def test_quick_run_writes_every_variant(tmp_path):
    from benchmarks.speed.bench_stack import main

    out = tmp_path / "stack"
    payload = main(["--quick", "--out", str(out), "--threads", "1"])
    stored = json.loads(out.with_suffix(".json").read_text())
    assert stored["cases"] == json.loads(json.dumps(payload["cases"]))
    variants = stored["cases"][0]["variants"]
    assert set(variants) == {"dense eager", "dense compiled", "tt eager fp32", "tt compiled",
                             "tt bf16 autocast", "dense bf16 autocast"}
    for timing in variants.values():
        assert math.isfinite(timing["median_s"]) and timing["median_s"] > 0
        assert timing["min_s"] <= timing["median_s"] <= timing["max_s"]
    assert "| tt compiled |" in out.with_suffix(".md").read_text()
    assert stored["machine"]["threads"] == 1
