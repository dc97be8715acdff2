"""Dense and CoMERA side by side on one task: run both, then write the summary files.

    summary = run_experiment(task, EngineConfig(), Path("runs/transformer"))
    print(summary_table(summary))

The summary has one row per model state worth comparing: the dense baseline, CoMERA at the end
of its early stage, and CoMERA at the end of its late stage. Each row carries the median time per
training step (of that stage), the validation and test scores and the parameter counts; speed-up
and compression are relative to the dense row and the dense size of the same layers. Files
written into ``out``: ``<task>.json``, ``<task>.md`` and the plots of :mod:`.plots`.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
import platform
import statistics
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from comera.experiments.distributed import current_world
from comera.experiments.engine import EngineConfig, Progress, RunRecord, train_model
from comera.experiments.task import Task

log = logging.getLogger("comera.experiments")

VARIANTS = ("dense", "comera")


def _stage_ms(record: RunRecord, first: int, end: int) -> float:
    times = [t for (step, *_), t in zip(record.train_curve, record.step_times, strict=True)
             if first <= step < end]
    return statistics.median(times) * 1e3 if times else float("nan")


def rows_of(record: RunRecord, config: EngineConfig) -> list[dict[str, Any]]:
    """The comparable states of one run (dense: one row; CoMERA: one per finished stage)."""
    rows = []
    dense_end = config.steps_early if config.stage == "early" else config.total_steps
    bounds = {"dense": (0, dense_end), "early": (0, config.steps_early),
              "late": (config.steps_early, config.total_steps)}
    for stage, end in record.stage_ends.items():
        first, last = bounds[stage]
        name = record.name if stage == "dense" else f"{record.name} ({stage})"
        rows.append({"name": name, "stage": stage, "step": end["step"],
                     "ms_per_step": _stage_ms(record, first, last),
                     "val": end["val"], "test": end["test"], "sizes": end["sizes"]})
    return rows


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).resolve().parent, check=False,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine(device: str | torch.device = "cpu") -> dict[str, Any]:
    """Where a result was measured: torch and Python versions, CPU model, cores, torch
    threads, data-parallel workers, the device's name, the git commit and the UTC date. Every
    experiment summary and benchmark result records it (the one home of this fingerprint), so
    timings are compared only within one machine."""
    device = torch.device(device)
    cpu = _cpu_model()
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            and torch.cuda.is_available() else cpu)
    return {"torch": torch.__version__, "python": platform.python_version(), "cpu": cpu,
            "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "workers": current_world().size, "device": str(device), "device_name": name,
            "commit": _commit(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


def run_experiment(task: Task, config: EngineConfig, out: Path,
                   variants: tuple[str, ...] = VARIANTS, resume: bool = False,
                   progress: Progress | None = None) -> dict[str, Any]:
    """Train each variant of ``task`` ("dense", "comera") and write the summary into ``out``."""
    out = Path(out)
    records = []
    for name in variants:
        _, record = train_model(task, name, name != "dense", config, out, resume, progress)
        records.append(record)
    rows = [row for r in records for row in rows_of(r, config)]
    dense = next((r for r in rows if r["stage"] == "dense"), None)
    for row in rows:
        row["speedup"] = (dense["ms_per_step"] / row["ms_per_step"]
                          if dense and row["ms_per_step"] > 0 else float("nan"))
    summary = {"task": task.name, "metric": task.metric,
               "higher_is_better": task.higher_is_better, "data": task.describe(),
               "config": asdict(config), "machine": machine(), "rows": rows,
               "runs": [asdict(r) for r in records]}
    if current_world().is_main:
        write_summary(summary, out)
    return summary


def write_summary(summary: dict[str, Any], out: Path) -> list[Path]:
    """``<task>.json``, ``<task>.md`` and the plots; returns the paths written."""
    from comera.experiments import plots

    out.mkdir(parents=True, exist_ok=True)
    name = summary["task"]
    paths = [out / f"{name}.json", out / f"{name}.md"]
    paths[0].write_text(json.dumps(summary, indent=1, default=_plain))
    paths[1].write_text(summary_table(summary) + "\n")
    paths += plots.write_plots(summary, out)
    return paths


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


def _fmt_int(value: float | None) -> str:
    return "-" if value is None else f"{int(value):,}"


def summary_table(summary: dict[str, Any]) -> str:
    """The headline table in markdown: speed, scores, sizes and compression per row."""
    metric = summary["metric"]
    lines = [f"| model | ms/step | speed-up | val {metric} | test {metric} | TT-layer params "
             "| compression (TT layers) | linear layers | embeddings | model params |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in summary["rows"]:
        s = row["sizes"]

        def ratio(key: str, sizes: dict = s) -> str:
            return f"{sizes[key]:.1f}x" if key in sizes else "-"

        lines.append(
            f"| {row['name']} | {row['ms_per_step']:.1f} | {row['speedup']:.2f}x | "
            f"{row['val'][metric]:.4f} | {row['test'][metric]:.4f} | "
            f"{_fmt_int(s.get('tt_params'))} | {ratio('tt_compression')} | "
            f"{ratio('linear_compression')} | {ratio('embedding_compression')} | "
            f"{_fmt_int(s.get('model_params'))} |")
    return "\n".join(lines)
