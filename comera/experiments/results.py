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
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from comera.batches import to_device
from comera.errors import CheckpointError, ConfigError, TrainingStopped
from comera.experiments.distributed import current_world
from comera.experiments.engine import (
    EngineConfig,
    Progress,
    RunRecord,
    check_settings,
    check_task,
    train_model,
)
from comera.experiments.rundir import check_run_directory, hold_run_directory
from comera.experiments.step_cost import probe_step
from comera.experiments.task import IndexStream, Task, build_task_model
from comera.formats.registry import DENSE
from tncomp.files import atomic_write_text

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


def _peak_bytes(task: Task, model: nn.Module, stage: str, config: EngineConfig) -> int | None:
    """Peak memory of one training step of the row's model (:func:`~comera.experiments.
    step_cost.probe_step`): the trained model, except an early-stage row whose run went on to
    the late stage (its ranks were truncated since), measured on a fresh model of the shapes
    the early stage trained. None under data parallelism (a worker alone cannot step)."""
    if current_world().size > 1:
        return None
    config = variant_config(config, "dense" if stage == "dense" else "comera")
    if stage == "early" and config.stage != "early" and config.steps_late:
        model = build_task_model(task, config.format).to(next(model.parameters()).device)
    batch = to_device(task.step_batch(IndexStream(task.train_size(), config.batch_size,
                                                  config.seed), 0), next(model.parameters()).device)
    cost = probe_step(model, lambda m: task.loss(m, batch), config, inputs=_tensors(batch),
                      steps=1)  # the row's time is the run's own median
    return cost.peak_bytes


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, list | tuple):
        return [t for b in batch for t in _tensors(b)]
    if isinstance(batch, dict):
        return [t for b in batch.values() for t in _tensors(b)]
    return []


def variant_config(config: EngineConfig, variant: str) -> EngineConfig:
    """The config of one variant of an experiment on ``config`` (whose ``format`` is the CoMERA
    run's): ``"comera"`` runs it as it is, ``"dense"`` with ``format="dense"``."""
    return replace(config, format=DENSE) if variant == "dense" else config


def check_experiment(config: EngineConfig, out: Path, variants: tuple[str, ...] = VARIANTS,
                     resume: bool = False, world_size: int = 1) -> None:
    """Refuse, before any training and without writing, an experiment that cannot run: bad
    settings (:func:`~comera.experiments.engine.check_settings`), unknown variants, ``resume``
    with no checkpoint to resume from, an ``out`` that is busy or not writable."""
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise ConfigError(f"variants {','.join(variants)!r}: choose from {','.join(VARIANTS)}.")
    if "comera" in variants and config.format == DENSE:
        raise ConfigError("format='dense' for the comera variant: it is the compressed model; "
                          "give format a registered format, e.g. 'tt' (the dense variant is "
                          "the dense one).")
    for variant in variants:
        check_settings(variant_config(config, variant), world_size=world_size)
    out = Path(out)
    if resume and not any((out / "checkpoints" / f"{v}.pt").is_file() for v in variants):
        raise CheckpointError(f"--resume: {out / 'checkpoints'} holds no checkpoint of "
                              f"{' or '.join(variants)} to resume from; point --out at the run's "
                              "directory, or start without --resume.")
    if current_world().is_main:  # the other workers find it held by the main one
        check_run_directory(out)


def run_experiment(task: Task, config: EngineConfig, out: Path,
                   variants: tuple[str, ...] = VARIANTS, resume: bool = False,
                   progress: Progress | None = None) -> dict[str, Any]:
    """Train each variant of ``task`` ("dense", "comera") and write the summary into ``out``.

    Everything is checked before any training (:func:`check_experiment`); ``resume`` continues
    the experiment in ``out`` and needs at least one of its checkpoints (a variant without one
    starts fresh); ``out`` is held for the whole experiment, so a second one on it is refused.
    """
    out = Path(out)
    check_experiment(config, out, variants, resume, current_world().size)
    for variant in variants:
        check_task(task, variant_config(config, variant))
    holding = hold_run_directory(out) if current_world().is_main else nullcontext(out)
    with holding:
        return _run(task, config, out, variants, resume, progress)


def _run(task: Task, config: EngineConfig, out: Path, variants: tuple[str, ...], resume: bool,
         progress: Progress | None) -> dict[str, Any]:
    records, rows = [], []
    for name in variants:
        model, record = train_model(task, name, variant_config(config, name), out,
                                    resume=resume, progress=progress)
        records.append(record)
        for row in rows_of(record, config):
            row["peak_bytes"] = _peak_bytes(task, model, row["stage"], config)
            rows.append(row)
        del model
    dense = next((r for r in rows if r["stage"] == "dense"), None)
    for row in rows:
        row["speedup"] = (dense["ms_per_step"] / row["ms_per_step"]
                          if dense and row["ms_per_step"] > 0 else float("nan"))
    summary = {"task": task.name, "metric": task.metric,
               "higher_is_better": task.higher_is_better, "data": task.describe(),
               "config": asdict(config), "machine": machine(), "rows": rows,
               "runs": [asdict(r) for r in records]}
    at_scale = getattr(task, "at_scale", None)
    if at_scale is not None and current_world().size == 1 and "comera" in variants \
            and "dense" in variants:
        scale = at_scale(config)
        if scale is not None:
            summary["at_scale"] = scale
    if current_world().is_main:
        write_summary(summary, out)
    return summary


def write_summary(summary: dict[str, Any], out: Path) -> list[Path]:
    """``<task>.json``, ``<task>.md`` and the plots; returns the paths written.

    Each file is written whole or not at all (``tncomp.files.atomic_write_bytes``: a planted
    link is replaced, never written through). A failed write (a full disk) raises
    :class:`~comera.errors.TrainingStopped` naming the file and the cause; the files written
    before it, and the run's checkpoints, stay as they were.
    """
    from comera.experiments import plots

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    name = summary["task"]
    texts = {out / f"{name}.json": json.dumps(summary, indent=1, default=_plain),
             out / f"{name}.md": summary_table(summary) + "\n"}  # both built before writing
    paths = []
    for path, text in texts.items():
        _write(path, lambda p, t=text: atomic_write_text(p, t))
        paths.append(path)
    paths += plots.write_plots(summary, out, write=_write)
    return paths


def _write(path: Path, write: Callable[[Path], None]) -> None:
    """``write(path)``, its ``OSError`` (a full disk, a read-only folder) as one clear error."""
    try:
        write(path)
    except OSError as exc:
        raise TrainingStopped(
            f"could not write {path} ({exc.strerror or exc}); nothing half-written was left. "
            f"The run's checkpoints in {path.parent / 'checkpoints'} are complete: free space "
            "and run the same command with --resume to write the summary.") from None


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


def _fmt_int(value: float | None) -> str:
    return "-" if value is None else f"{int(value):,}"


def _fmt(value: float, spec: str, suffix: str = "") -> str:
    """A number, or "n/a" where there is none (NaN: e.g. a speed-up without a dense row)."""
    value = float(value)  # a summary read back from JSON spells NaN as "nan"
    return f"{value:{spec}}{suffix}" if math.isfinite(value) else "n/a"


def _ratio(sizes: dict[str, float], kind: str) -> str:
    """``<kind>_compression``; "removed" when every such layer was pruned away (0 parameters
    left, where a ratio would print the dense size as if it were a compression)."""
    if f"{kind}_compression" not in sizes:
        return "-"
    if sizes.get(f"{kind}_params", 1) == 0:
        return "removed"
    return _fmt(sizes[f"{kind}_compression"], ".1f", "x")


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.1f}"


def summary_table(summary: dict[str, Any]) -> str:
    """The headline table in markdown: speed, peak memory, scores, sizes and compression per
    row, what each column measures under it, and (:func:`at_scale_table`) the step at larger
    tables when the task measured it."""
    metric = summary["metric"]
    lines = [f"| model | ms/step | speed-up | peak MiB | val {metric} | test {metric} "
             "| TT-layer params | compression (TT layers) | linear layers | embeddings "
             "| model params |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in summary["rows"]:
        s = row["sizes"]
        lines.append(
            f"| {row['name']} | {_fmt(row['ms_per_step'], '.1f')} | "
            f"{_fmt(row['speedup'], '.2f', 'x')} | {_mib(row.get('peak_bytes'))} | "
            f"{_fmt(row['val'][metric], '.4f')} | {_fmt(row['test'][metric], '.4f')} | "
            f"{_fmt_int(s.get('tt_params'))} | {_ratio(s, 'tt')} | "
            f"{_ratio(s, 'linear')} | {_ratio(s, 'embedding')} | "
            f"{_fmt_int(s.get('model_params'))} |")
    # no thread count here: each run picks its own (engine), and the summary does not see it
    lines += ["", "ms/step: median of the stage's training steps; peak MiB: one training step "
              "of the row's model (parameters, optimizer state, batch, and the most allocated "
              "during the step); params at the effective ranks."]
    if summary.get("at_scale"):
        lines += ["", at_scale_table(summary["at_scale"])]
    return "\n".join(lines)


def at_scale_table(scale: dict[str, Any]) -> str:
    """The training step of the same model at larger tables (a task's ``at_scale``, e.g.
    :meth:`~comera.experiments.dlrm_task.DLRMTask.at_scale`): dense vs TT time and peak
    memory per table cap, and the cap from which the TT tables were faster."""
    rungs = scale["rungs"]
    lines = [f"The same step at larger tables (every table capped at more rows; batch "
             f"{scale['batch_size']}, {scale['threads']} thread{'s' * (scale['threads'] != 1)}, "
             f"load average {scale['load_average'][0][0]}; TT tables at their initial ranks "
             f"{scale['tt_ranks']}, {scale['tt_cache_rows']} hot rows; median of "
             f"{len(rungs[0]['dense']['step_ms'])} steps):", "",
             "| rows per table | table rows | dense ms/step | TT ms/step | TT speed-up "
             "| dense peak MiB | TT peak MiB | TT memory saving |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rungs:
        dense, tt = r["dense"], r["tt"]
        lines.append(f"| {r['max_rows']:,} | {r['table_rows']:,} | {dense['ms']:,.1f} | "
                     f"{tt['ms']:,.1f} | {dense['ms'] / tt['ms']:.2f}x | "
                     f"{_mib(dense['peak_bytes'])} | {_mib(tt['peak_bytes'])} | "
                     f"{dense['peak_bytes'] / tt['peak_bytes']:.1f}x |")
    kaggle = (f"the full Kaggle tables hold {scale['kaggle_rows']:,} rows, "
              f"{scale['kaggle_dense_table_bytes'] / 1e9:.2f} GB as dense fp32 tables")
    if scale["tt_faster_from"] is None:
        verdict = (f"TT tables were slower at every size measured (up to "
                   f"{rungs[-1]['max_rows']:,} rows per table); {kaggle}.")
    else:
        verdict = (f"TT tables were faster than dense ones from {scale['tt_faster_from']:,} "
                   f"rows per table on (at every larger size measured); {kaggle}.")
    return "\n".join([*lines, "", verdict])
