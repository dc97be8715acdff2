"""Results are data, not history: every file committed under benchmarks/results/ stays under
a stated size, a full rerun of any study grows the repository's pack by less than a stated
size, and the studies' per-step curves live in git-ignored ``curves/`` folders."""

from __future__ import annotations

import shutil
import subprocess
import zlib
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
LIMIT = 512 * 1024  # bytes: a summary JSON, a table or a plot; per-step curves go to curves/
RERUN_LIMIT = 2**20  # bytes a full rerun of one study may add to the pack (issue 43)
TREES_AND_COMMIT = 16 * 1024  # bytes: the rerun's commit and the trees above its folder


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


def rerun_groups(files: list[Path], results: Path = RESULTS) -> dict[str, list[Path]]:
    """The committed files one rerun rewrites, by what writes them: a study's folder
    (``lm_frontier_d256/...``, nested folders included) or a speed benchmark's files at the top
    (``formats_cpu.json``, ``.md``, ``.png``: grouped by stem)."""
    groups: dict[str, list[Path]] = defaultdict(list)
    for path in files:
        parts = path.relative_to(results).parts
        groups[parts[0] if len(parts) > 1 else path.stem].append(path)
    return dict(groups)


def blob_bytes(path: Path) -> int:
    """Bytes git stores for a new blob of ``path``'s content at most: its zlib stream at git's
    default level (a blob that deltas against its old version is stored smaller)."""
    return len(zlib.compress(path.read_bytes()))


def rerun_bound(files: list[Path]) -> int:
    """Bytes a rerun that rewrites every one of ``files`` (with content that compresses as
    theirs does) adds to the pack at most: a new blob per file, each entry of the new trees
    (mode, path, 20-byte id), and the commit and the trees above the folder. Measured once
    in a clone: a rerun-like rewrite of the largest folder grew the pack by its new blobs'
    zlib sizes to within 1%."""
    return (sum(blob_bytes(p) + len(p.name) + 32 for p in files) + TREES_AND_COMMIT)


def too_big_reruns(files: list[Path], results: Path = RESULTS,
                   limit: int = RERUN_LIMIT) -> list[str]:
    """One line per rerun group whose :func:`rerun_bound` is ``limit`` or more: the folder,
    its bound and its three largest files (compressed)."""
    lines = []
    for name, group in sorted(rerun_groups(files, results).items()):
        bound = rerun_bound(group)
        if bound >= limit:
            biggest = sorted(group, key=blob_bytes, reverse=True)[:3]
            shown = ", ".join(f"{p.relative_to(results)} ({blob_bytes(p) // 1024} KiB)"
                              for p in biggest)
            lines.append(f"{name}: {bound / 2**20:.2f} MiB (largest: {shown})")
    return lines


def test_a_full_rerun_of_any_study_grows_the_pack_by_under_a_mib():
    """A rerun rewrites at most every file of its folder and git stores each new blob zlib-
    compressed, so the compressed sizes bound what a rerun adds to the pack."""
    files = [p for p in committed() if p.is_file()]
    assert len(rerun_groups(files)) > 10  # the studies' folders and the speed benchmarks
    big = too_big_reruns(files)
    assert not big, (f"a full rerun would grow the pack by {RERUN_LIMIT // 2**20} MiB or more: "
                     f"{big}; commit a summary (tables, plots, a JSON without per-step curves) "
                     "and write the rest to the study's curves/ folder (git-ignored)")


def test_the_rerun_bound_names_a_folder_over_the_limit(tmp_path):
    import random

    rng = random.Random(0)
    study = tmp_path / "study" / "d4"
    study.mkdir(parents=True)
    for k in range(3):  # incompressible: three files of 400 KiB are 1.2 MiB in the pack
        (study / f"curve{k}.json").write_bytes(rng.randbytes(400 * 1024))
    (tmp_path / "bench_cpu.md").write_text("| a |\n|---|\n| 1 |\n" * 1000)  # compresses well
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert set(rerun_groups(files, tmp_path)) == {"study", "bench_cpu"}
    (line,) = too_big_reruns(files, tmp_path)
    assert line.startswith("study: 1.") and "study/d4/curve" in line and "(400 KiB)" in line
    assert too_big_reruns(files[:1] + files[2:], tmp_path) == []  # two files: 0.8 MiB
