"""bench_plan_ops: every step of a compressed layer's plan beside its shape's time and its floor."""

from __future__ import annotations

import json

import pytest

from benchmarks.speed.bench_plan_ops import main


def test_smoke_sets_every_step_beside_its_shape_and_floor(tmp_path):
    out = tmp_path / "plan_ops"
    assert main(["--smoke", "--out", str(out)]) == 0
    payload = json.loads(out.with_suffix(".json").read_text())
    (width,) = payload["widths"]
    assert set(width["layers"]) == {"attn.q", "ffn_in", "ffn_out"}
    assert payload["rates"]["gemm_flops_per_s"] > 0 and payload["rates"]["copy_bytes_per_s"] > 0
    for layer in width["layers"].values():
        kinds = {s["kind"] for s in layer["steps"]}
        assert "gemm" in kinds and {s["pass"] for s in layer["steps"]} == {"fwd", "bwd"}
        for step in layer["steps"]:
            assert step["ms"] >= 0
            if step["kind"] == "gemm":
                assert step["shape_ms"] > 0 and step["floor_ms"] > 0 and step["mflop"] > 0
            if step["kind"] == "copy":
                assert step["copy_kind"] in ("runs", "transpose", "gather")
        gemm = layer["sums"]["gemm"]
        assert gemm["ms"] == pytest.approx(sum(s["ms"] for s in layer["steps"]
                                               if s["kind"] == "gemm"))
    assert "| layer |" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("args", [["--d-model", "30"], ["--repeats", "0"], ["--format", "x"]])
def test_refuses_bad_arguments_before_measuring(args, tmp_path, capsys):
    out = tmp_path / "plan_ops"
    with pytest.raises(SystemExit) as exc:
        main([*args, "--out", str(out)])
    assert exc.value.code == 2
    assert args[0] in capsys.readouterr().err
    assert not out.with_suffix(".json").exists()
