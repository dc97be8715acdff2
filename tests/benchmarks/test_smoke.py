"""Every benchmark script runs end to end in its quickest mode (``--smoke``), in a subprocess
as a user runs it (``python -m benchmarks.<script>``), and writes its results files: a script
that reads a private field, or a results layout that drifted, fails here rather than in
``make bench``. The ratios in the results carry their spread over repeats."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("bench_*.py"))
HEAVY = {"bench_transformer"}  # builds three model variants: slow on a shared 2-core CPU


def run_smoke(script: str, tmp_path) -> dict:
    """Run ``script --smoke`` in a subprocess; its results payload."""
    out = tmp_path / script
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{script}", "--smoke", "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert out.with_suffix(".md").read_text().startswith("# ")
    return json.loads(out.with_suffix(".json").read_text())


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


def test_no_script_patches_the_import_path():
    # scripts run as modules from the repository root; the library is benchmarks.lib
    patched = [p.name for p in (ROOT / "benchmarks").rglob("*.py") if "sys.path" in p.read_text()]
    assert patched == []
