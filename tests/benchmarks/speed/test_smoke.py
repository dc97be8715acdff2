"""Every benchmark script runs end to end in its quickest mode (``--smoke``), in a subprocess
as a user runs it (``python -m benchmarks.<script>``), and writes its results files: a script
that reads a private field, or a results layout that drifted, fails here rather than in
``make bench``. The ratios in the results carry their spread over repeats."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT

SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks" / "speed").glob("bench_*.py"))
HEAVY = {"bench_transformer"}  # builds three model variants: slow on a shared 2-core CPU


def run_smoke(script: str, tmp_path) -> dict:
    """Run ``script --smoke`` in a subprocess; its results payload."""
    out = tmp_path / script
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.speed.{script}", "--smoke", "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert out.with_suffix(".md").read_text().startswith("# ")
    payload = json.loads(out.with_suffix(".json").read_text())
    payload["_out"] = str(out)  # where the files went (for a script's own checks)
    return payload


def test_every_script_is_covered():
    assert {"bench_tt_linear", "bench_dlrm", "bench_transformer"} <= set(SCRIPTS)


@pytest.fixture(scope="module")
def payloads(tmp_path_factory) -> dict:
    """Each light script's smoke payload, run once per module on first use."""

    class Lazy(dict):
        def __missing__(self, script):
            self[script] = run_smoke(script, tmp_path_factory.mktemp(script))
            return self[script]

    return Lazy()


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s not in HEAVY])
def test_script_runs_in_smoke_mode(script, payloads):
    payload = payloads[script]
    assert {"torch", "cpu", "cores", "threads", "commit", "date", "device_name"} <= set(
        payload["machine"])


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(HEAVY))
def test_heavy_script_runs_in_smoke_mode(script, tmp_path):
    payload = run_smoke(script, tmp_path)
    assert "machine" in payload


def test_tt_linear_ratios_carry_their_spread(payloads):
    payload = payloads["bench_tt_linear"]
    (result,) = payload["results"]
    for key in ("vs_dense", "vs_hand"):
        spread = result["spread"][key]
        assert spread["repeats"] == 1
        assert spread["min"] <= spread["q1"] <= spread["q3"] <= spread["max"]
    assert set(payload["dispatch_overhead"]) == {
        "call_us", "einsum_us", "call_with_autograd_us", "einsum_with_autograd_us"}


def test_tt_linear_every_ratio_carries_its_spread(payloads):
    (result,) = payloads["bench_tt_linear"]["results"]
    assert set(result["spread"]) == {f"{name}_vs_tncomp" for name in result["ms"]
                                     if name != "tncomp"} | {"vs_dense", "vs_hand"}


def test_growth_sweeps_planning_and_plot(payloads):
    payload = payloads["bench_growth"]
    assert set(payload["sweeps"]) == {"batch", "rank", "d"}
    base = payload["base"]
    for key, points in payload["sweeps"].items():
        for p in points:
            assert {k: p[k] for k in base if k != key} == {k: v for k, v in base.items()
                                                            if k != key}
            assert p["ms"]["tt"] > 0 and p["ms"]["dense"] > 0
            spread = p["dense_over_tt"]
            assert spread["min"] <= spread["q1"] <= spread["q3"] <= spread["max"]
            for name in ("tt", "dense"):
                assert p["memory"][name]["peak_alloc_mib"] >= p["memory"][name]["params_mib"]
    assert [p["d"] for p in payload["planning"]] == [p["d"] for p in payload["sweeps"]["d"]]
    assert all(p["plan_s"] > 0 for p in payload["planning"])
    png = Path(payload["_out"]).with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_embedding_compares_three_methods(payloads):
    result = payloads["bench_embedding"]["result"]
    assert set(result["ms"]) == {"tt_embedding", "naive_gather", "nn_embedding"}
    assert 0 < result["unique_ids"] <= result["batch"]
    assert set(result["spread"]) == {"naive_vs_tt", "nn_embedding_vs_tt"}


def test_no_script_patches_the_import_path():
    # scripts run as modules from the repository root; the library is benchmarks.lib
    patched = [p.name for p in (ROOT / "benchmarks").rglob("*.py") if "sys.path" in p.read_text()]
    assert patched == []


def test_tt_linear_names_its_device_and_refuses_cuda_without_one(payloads, tmp_path):
    assert payloads["bench_tt_linear"]["device"] == "CPU"
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device cuda is a real run here")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "cuda"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.speed.bench_tt_linear", "--smoke",
                           "--device", "cuda", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2
    assert "--device cuda" in proc.stderr and "--device cpu" in proc.stderr
    assert not out.with_suffix(".json").exists()


def test_gpt_step_compares_every_format_with_dense_and_a_narrower_model(payloads):
    payload = payloads["bench_gpt_step"]
    (width,) = payload["widths"]
    rows = {r["model"]: r for r in width["rows"]}
    assert set(rows) == {"dense", "ttm", "btt", "tt", "lowrank", "narrow"}
    assert rows["dense"]["block_compression"] == 1.0
    assert rows["narrow"]["d_model"] < rows["dense"]["d_model"]
    for name, row in rows.items():
        spread = row["vs_dense"]
        assert spread["min"] <= spread["q1"] <= spread["q3"] <= spread["max"]
        assert row["peak_extra_mib"] > 0
        assert bool(row["layers"]) == (name not in ("dense", "narrow"))
        for layer in row["layers"]:
            assert layer["floor_ms"] > 0 and layer["ms"] > 0
            assert {s["pass"] for s in layer["steps"]} == {"fwd", "bwd"}
    assert "The machine" in payload["note_machine"]


@pytest.mark.parametrize("args", [["--d-model", "30"], ["--repeats", "0"], ["--threads", "0"]])
def test_gpt_step_refuses_bad_arguments_before_measuring(args, tmp_path, capsys):
    from benchmarks.speed.bench_gpt_step import main

    out = tmp_path / "gpt"
    with pytest.raises(SystemExit) as exc:
        main([*args, "--out", str(out)])
    assert exc.value.code == 2
    assert args[0] in capsys.readouterr().err
    assert not out.with_suffix(".json").exists()


def test_gpt_step_runs_each_format_at_each_memory_mode(tmp_path):
    """``--memory fast min``: the min rows are the same format at the same ratio, with the
    backward recomputing what the fast rows keep, so their step peak is lower."""
    from benchmarks.speed.bench_gpt_step import main

    out = tmp_path / "gpt_mem"
    assert main(["--smoke", "--formats", "btt", "--memory", "fast", "min", "--out", str(out)]) == 0
    (width,) = json.loads(out.with_suffix(".json").read_text())["widths"]
    rows = {r["model"]: r for r in width["rows"]}
    assert set(rows) == {"dense", "btt", "btt/min", "narrow"}
    assert rows["btt/min"]["block_compression"] == rows["btt"]["block_compression"]
    assert rows["btt/min"]["peak_extra_mib"] < rows["btt"]["peak_extra_mib"]
