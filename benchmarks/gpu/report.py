"""The results of ``make gpu``: one JSON and one Markdown file per part and a summary
(``benchmarks/results/*_cuda.{json,md}``), the issue's targets checked against the numbers, and
the summary table the script prints. Views take values: everything here reads the parts'
payloads (plain dicts) and measures nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.lib.measure import markdown_table

FILES = {"tests": "gpu_tests_cuda", "layer": "tt_layer_cuda", "step": "transformer_step_cuda",
         "dlrm": "dlrm_step_cuda"}
SUMMARY = "gpu_cuda"
TT_METHODS = ("tncomp", "tncomp_cuda_graphs", "torch_compile")


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _cases(payload: dict[str, Any], part: str) -> list[dict[str, Any]]:
    return list(payload.get("parts", {}).get(part, {}).get("cases", []))


def _step_ms(cases: list[dict], variant: str, dtype: str, batch: int,
             modes: tuple[str, ...] | None = None) -> tuple[float, float | None, str] | None:
    """(ms, peak MiB, mode) of the fastest of ``variant``'s steps in ``modes`` (all: None)."""
    found = [c for c in cases if c["variant"] == variant and c["dtype"] == dtype
             and c["batch"] == batch and (modes is None or c["mode"] in modes)]
    if not found:
        return None
    best = min(found, key=lambda c: c["ms"])
    return best["ms"], best.get("peak_mib"), best["mode"]


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None or den <= 0 else num / den


def targets(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured value (None: not measured in this run)."""
    rows: list[dict[str, Any]] = []
    steps = _cases(payload, "step")

    def add(claim: str, value: float | None, target: float, how: str) -> None:
        rows.append({"claim": claim, "measured": value, "target": target, "how": how,
                     "met": None if value is None else value >= target})

    eager_only = ("eager",)  # a graph replay allocates nothing: its peak is not comparable
    for name in ("comera_late", "comera_early"):
        dense, mine = _step_ms(steps, "dense", "bf16", 32), _step_ms(steps, name, "bf16", 32)
        add(f"step B=32 bf16: {name} faster than dense", _ratio(
            dense and dense[0], mine and mine[0]), 2.0, "fastest mode of each")
        dense, mine = (_step_ms(steps, v, "bf16", 32, eager_only) for v in ("dense", name))
        add(f"step B=32 bf16: {name} peak memory below dense", _ratio(
            dense and dense[1], mine and mine[1]), 2.0, "eager peaks")
        galore, mine1 = _step_ms(steps, "galore", "bf16", 1), _step_ms(steps, name, "bf16", 1)
        add(f"step B=1 bf16: {name} faster than GaLore", _ratio(
            galore and galore[0], mine1 and mine1[0]), 2.0, "GaLore eager, CoMERA fastest")
        galore, mine1 = (_step_ms(steps, v, "bf16", 1, eager_only) for v in ("galore", name))
        add(f"step B=1 bf16: {name} peak memory below GaLore", _ratio(
            galore and galore[1], mine1 and mine1[1]), 9.0, "eager peaks")
        eager = _step_ms(steps, name, "bf16", 1, ("eager",))
        captured = _step_ms(steps, name, "bf16", 1, ("graphs", "compile"))
        add(f"step B=1 bf16: {name} CUDA graphs / reduce-overhead over eager", _ratio(
            eager and eager[0], captured and captured[0]), 1.5, "best captured mode")
    for label, rows_ in (("768x3072", 4096), ("llama1b", 8192)):
        case = next((c for c in _cases(payload, "layer") if c["case"].startswith(label)
                     and c["rows"] == rows_ and c["dtype"] == "bf16"), None)
        value = None
        if case is not None:
            ms = [case["methods"][m]["ms"] for m in TT_METHODS
                  if "ms" in case["methods"].get(m, {})]
            dense = case["methods"].get("dense", {}).get("ms")
            value = _ratio(dense, min(ms)) if ms else None
        add(f"TT layer {label} B={rows_} bf16 fwd+bwd faster than dense (cuBLAS)", value, 1.5,
            "fastest tncomp method vs dense bf16")
    return rows


def part_markdown(name: str, part: dict[str, Any]) -> str:
    """One part's table (and its skips, errors and status)."""
    lines = [f"## {name}: {part.get('status', '?')}, {_f(part.get('wall_s'), 0)} s "
             f"of {_f(part.get('budget_s'), 0)} s"]
    cases = part.get("cases", [])
    if name == "tests":
        lines.append(f"{part.get('passed', 0)} passed, {len(part.get('failed', []))} failed, "
                     f"{part.get('skipped_tests', 0)} skipped")
        lines += [f"- failed: {t}" for t in part.get("failed", [])]
    elif name == "layer" and cases:
        methods = sorted({m for c in cases for m in c["methods"]})
        rows = [[c["case"], f"{c['param_ratio']:.1f}x"] + [
            f"{_f(c['methods'][m].get('ms'))} ms / {_f(c['methods'][m].get('peak_mib'), 0)} MiB"
            if m in c["methods"] and "ms" in c["methods"][m] else "error" if m in c["methods"]
            else "-" for m in methods] + [_f(c.get("floor_ms"))] for c in cases]
        lines.append(markdown_table(["case", "fewer params", *methods, "tncomp floor ms"],
                                    rows))
        lines += [f"- error in {c['case']} {m}: {s['error']}" for c in cases
                  for m, s in c["methods"].items() if "error" in s]
    elif name in ("step", "dlrm") and cases:
        keys = ("variant", "mode", "dtype", "batch") if name == "step" else ("variant", "batch")
        rows = [[c[k] for k in keys] + [_f(c["ms"]), _f(c.get("peak_mib"), 0),
                                        c.get("captures", "-")] for c in cases]
        lines.append(markdown_table([*keys, "ms", "peak MiB", "captures"], rows))
    for note, value in part.get("notes", {}).items():
        lines.append(f"- note ({note}): {value}")
    lines += [f"- skipped {s['case']}: {s['why']}" for s in part.get("skipped", [])]
    lines += [f"- error in {e['case']}: {e['error']}" for e in part.get("errors", [])]
    return "\n".join(lines)


def _header(payload: dict[str, Any]) -> str:
    d = payload.get("device", {})
    return (f"device {d.get('device_name', '?')} (capability {d.get('capability', '?')}), "
            f"torch {d.get('torch', '?')}, CUDA {d.get('cuda', '?')}, commit "
            f"{d.get('commit', '?')}, {d.get('date', '?')}")


def summary_table(payload: dict[str, Any]) -> str:
    """The targets as a table, under the device line (what the script prints at the end)."""
    rows = [[t["claim"], _f(t["measured"]) + ("x" if t["measured"] is not None else ""),
             f">= {t['target']}x", {True: "yes", False: "no", None: "not measured"}[t["met"]]]
            for t in payload.get("targets", [])]
    parts = ", ".join(f"{n}: {p.get('status')}" for n, p in payload.get("parts", {}).items())
    return "\n".join([_header(payload), f"parts: {parts}", "",
                      markdown_table(["claim", "measured", "target", "met"], rows)])


def write_results(out_dir: str | Path, payload: dict[str, Any]) -> list[Path]:
    """Write each part's ``<name>_cuda.{json,md}`` and the summary ``gpu_cuda.{json,md}``
    (``payload``: ``device`` and ``parts``; ``targets`` are added here). Returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {**payload, "targets": targets(payload)}
    written = []

    def write(stem: str, data: dict[str, Any], markdown: str) -> None:
        for suffix, text in ((".json", json.dumps(data, indent=2, default=str) + "\n"),
                             (".md", markdown + "\n")):
            path = out / f"{stem}{suffix}"
            path.write_text(text)
            written.append(path)

    for name, part in payload.get("parts", {}).items():
        write(FILES.get(name, f"{name}_cuda"), {"device": payload.get("device"), **part},
              f"# make gpu: {name}\n\n{_header(payload)}\n\n{part_markdown(name, part)}")
    body = "\n\n".join(part_markdown(n, p) for n, p in payload.get("parts", {}).items())
    write(SUMMARY, payload, f"# make gpu\n\n{summary_table(payload)}\n\n{body}")
    return written
