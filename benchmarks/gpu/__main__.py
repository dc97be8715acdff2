"""``make gpu`` / ``python -m benchmarks.gpu``: every GPU claim in one command, at most 9
minutes on one GPU (see :mod:`benchmarks.gpu` and docs/gpu.md).

Each part runs in a process of its own with a hard budget: past ``budget + GRACE_S`` seconds it
is interrupted (SIGINT, so pytest still writes its report of the tests that ran), then killed
``INTERRUPT_S`` later, and whatever it had saved (parts save after every case) is kept, marked
``timed_out``. Inside a part, a case that would not fit the part's budget is skipped and listed.
Then the results go to benchmarks/results/*_cuda.{json,md} and the targets table is printed.
Without CUDA, or run by a python without torch, it prints one line and exits 2, writing
nothing.

    python -m benchmarks.gpu                     # everything, ~9 minutes
    python -m benchmarks.gpu --parts layer,step  # some parts
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NO_TORCH = ("make gpu: {python} has no torch ({why}); it needs a python with CUDA torch: run "
            "make gpu PYTHON=/path/to/that/python (or python -m benchmarks.gpu with it).")
try:
    import torch
except ImportError as exc:  # before anything is written: one line, exit 2, as without CUDA
    print(NO_TORCH.format(python=sys.executable, why=exc), file=sys.stderr)
    raise SystemExit(2) from None

from benchmarks.gpu.common import NO_CUDA, device_info  # noqa: E402 (after the torch check)
from benchmarks.gpu.report import summary_table, targets, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
GRACE_S = 15.0  # a part past its budget by this much is interrupted
INTERRUPT_S = 10.0  # then killed this much later if still running


@dataclass(frozen=True)
class Part:
    """One part: its name and its budget in seconds."""

    name: str
    budget_s: float


# tests: 51 in 76 s on an H200, over 105 s on an H100 (2026-11-28); layer: 35 s and step's
# eager and graphs cases about 80 s on either
PARTS = (Part("tests", 140.0), Part("layer", 80.0), Part("step", 160.0), Part("dlrm", 60.0))
TOTAL_BUDGET_S = 540.0  # 9 minutes: the parts' budgets, grace and interrupt must fit in it


def run_part(cmd: list[str], budget_s: float, grace_s: float = GRACE_S,
             env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cmd`` (output shown live); past ``budget_s + grace_s`` interrupt its whole process
    group, and kill it ``INTERRUPT_S`` later if it has not stopped. Returns status ("ok",
    "failed (exit N)", "timed_out"), wall seconds, budget."""
    start = time.monotonic()
    # SIGINT back to its default in the child: a shell that ran this in the background set it to
    # ignored, and a python started so never raises KeyboardInterrupt (pytest writes no report)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        rc = proc.wait(timeout=budget_s + grace_s)
        status = "ok" if rc == 0 else f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)  # pytest writes its junit report on an interrupt
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=INTERRUPT_S)
        with contextlib.suppress(ProcessLookupError):  # the children, if the leader stopped
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        status = "timed_out"
    return {"status": status, "wall_s": round(time.monotonic() - start, 1),
            "budget_s": budget_s}


def junit_summary(path: Path) -> dict[str, Any]:
    """Passed, failed (names) and skipped counts of a pytest junit XML file."""
    if not path.is_file():
        return {"passed": 0, "failed": [], "skipped_tests": 0, "note": "no junit report written"}
    failed, skipped, total = [], 0, 0
    for case in ET.parse(path).getroot().iter("testcase"):
        if case.get("name") is None:  # the test an interrupt stopped: it has no result
            continue
        total += 1
        if case.find("skipped") is not None:
            skipped += 1
        elif case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    return {"passed": total - skipped - len(failed), "failed": failed, "skipped_tests": skipped}


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT),
            "PYTHONUNBUFFERED": "1"}


def run_tests(part: Part, work: Path) -> dict[str, Any]:
    report = work / "tests.xml"
    # a test module that cannot import on this machine's torch/transformers must not stop the
    # GPU tests of every other module: its import error is reported as a failure instead
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", f"--junitxml={report}", "tests"]
    return {**run_part(cmd, part.budget_s, env=_env()), **junit_summary(report)}


def run_benchmark(part: Part, work: Path, extra: list[str]) -> dict[str, Any]:
    out = work / f"{part.name}.json"
    cmd = [sys.executable, "-m", f"benchmarks.gpu.{part.name}", "--out", str(out),
           "--budget", str(part.budget_s), *extra]
    result = run_part(cmd, part.budget_s, env=_env())
    saved = json.loads(out.read_text()) if out.is_file() else {"cases": []}
    saved.pop("device", None)
    return {**saved, **result}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--parts", default=",".join(x.name for x in PARTS),
                   help="comma-separated subset of " + ", ".join(x.name for x in PARTS))
    p.add_argument("--out-dir", default=str(RESULTS), help="where the *_cuda files go")
    args = p.parse_args(argv)
    chosen = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = [x for x in chosen if x not in {part.name for part in PARTS}]
    if unknown or not chosen:
        print(f"--parts {args.parts!r}: unknown {unknown}; choose from "
              f"{', '.join(x.name for x in PARTS)}.", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    device = device_info("cuda")
    print(f"make gpu on {device['device_name']}: torch {device['torch']}, CUDA "
          f"{device['cuda']}; budget {TOTAL_BUDGET_S:.0f} s", flush=True)
    parts: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="make-gpu-") as tmp:
        for k, part in enumerate([x for x in PARTS if x.name in chosen], 1):
            print(f"[{k}/{len(chosen)}] {part.name} (budget {part.budget_s:.0f} s)", flush=True)
            parts[part.name] = (run_tests(part, Path(tmp)) if part.name == "tests"
                                else run_benchmark(part, Path(tmp), []))
            print(f"[{k}/{len(chosen)}] {part.name}: {parts[part.name]['status']} in "
                  f"{parts[part.name]['wall_s']} s", flush=True)
    payload = {"device": device, "parts": parts}
    paths = write_results(args.out_dir, payload)
    print("\n" + summary_table({**payload, "targets": targets(payload)}))
    print("\nwrote " + ", ".join(str(x.relative_to(ROOT)) if x.is_relative_to(ROOT) else str(x)
                                 for x in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
