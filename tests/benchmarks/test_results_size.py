"""Results are data, not history: every file committed under benchmarks/results/ stays under
a stated size, and the studies' per-step curves live in git-ignored ``curves/`` folders."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
LIMIT = 512 * 1024  # bytes: a summary JSON, a table or a plot; per-step curves go to curves/


def committed() -> list[Path]:
    """The files under benchmarks/results/ that git tracks (without git: every file outside a
    ``curves/`` folder)."""
    if shutil.which("git") and (ROOT / ".git").exists():
        out = subprocess.run(["git", "ls-files", "-z", "benchmarks/results"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        return [ROOT / name for name in out.split("\0") if name]
    return [p for p in RESULTS.rglob("*") if p.is_file() and "curves" not in p.parts]


def test_no_committed_result_file_exceeds_the_limit():
    files = [p for p in committed() if p.is_file()]
    assert files, "no committed results found"
    big = {str(p.relative_to(ROOT)): p.stat().st_size for p in files if p.stat().st_size > LIMIT}
    assert not big, (f"committed result files over {LIMIT // 1024} KiB: {big}; write per-step "
                     "curves and per-run copies to the study's curves/ folder (git-ignored)")


def test_no_committed_result_file_sits_in_a_curves_folder():
    assert not [p for p in committed() if "curves" in p.relative_to(RESULTS).parts[:-1]]


@pytest.mark.skipif(not shutil.which("git"), reason="needs git")
def test_git_ignores_every_study_curves_folder():
    paths = ["benchmarks/results/lm_frontier_d256/curves/runs/x.json",
             "benchmarks/results/heldout_gpt/curves/heldout.json",
             "benchmarks/results/lm_frontier_d256_order/d4/curves/runs/y.json"]
    proc = subprocess.run(["git", "check-ignore", *paths], cwd=ROOT, capture_output=True,
                          text=True, check=False)
    assert proc.stdout.split() == paths
    kept = subprocess.run(["git", "check-ignore", "benchmarks/results/heldout_gpt/heldout.json"],
                          cwd=ROOT, capture_output=True, check=False)
    assert kept.returncode == 1  # the summary itself is committed
