"""How the cost of a TT linear layer grows with the batch, the rank and the number of cores,
against the dense layer it replaces; and the cold planning time per number of cores.

The layer is 768 -> 3072 (a transformer's feed-forward projection): ``comera.TTLinear(768,
3072, ranks=r, d=d)`` with the modes comera's factorization picks for ``d``, against
``nn.Linear(768, 3072)``. One call is forward and backward (``y.backward(dy)``, the input
requiring grad as inside a network), then its gradients freed (within the call). Three sweeps, each
from the base point B=1024, rank 16, d=3:

- batch B in 1, 4, ..., 16384; rank r in 4, 8, 16, 32, 64; cores d in 2, 3, 4.

Time: median of interleaved repeats (TT and dense alternate) after warm-up, with the spread of
the per-round ratio. Memory, three counts, each saying what it sees (``benchmarks.lib.memory``):

- ``peak_alloc``: parameters plus the profiler's peak of the bytes allocated during one call
  above what was live before it (output, everything kept for backward, gradients,
  temporaries; tncomp's buffer pooling off) -- the plotted line;
- ``saved`` / ``held``: what autograd's saved-tensor hooks see (unique storages; the input and
  weights included) and the bytes allocated during the forward still live after it (the output
  and what is kept for backward by any route: tncomp keeps its intermediates on the autograd
  context, where the hooks do not look);
- ``rss_delta``: the process's peak resident set during one call above the resident set before
  it (Linux); meaningful only where a call allocates tens of MiB beyond what the allocator
  already holds, noise below that. Plotted dashed.

Planning: per d, a layer built with an empty disk-cache directory after ``tncomp.clear_cache()``;
``plan_s`` is ``layer.compiled().regimes()`` (the search of the batch regimes), ``first_call_s``
the first forward+backward after it (code generation plus the run). Measured in this process
after one warm-up plan of a different layer, so imports are not counted.

Writes benchmarks/results/growth_cpu.{json,md,png}. Timings are made with one torch thread by
default (``--threads``); other work on the machine widens the spreads.

    python -m benchmarks.speed.bench_growth                 # full: ~5-8 min on 2 quiet cores
    python -m benchmarks.speed.bench_growth --quick         # two points per sweep: ~1 min
    python -m benchmarks.speed.bench_growth --smoke --out /tmp/growth   # one repeat, tiny: seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

import comera
import tncomp
from benchmarks.lib.cli import add_out, check_at_least_one, run_header
from benchmarks.lib.measure import (
    interleaved_times,
    markdown_table,
    num_threads,
    peak_allocated_bytes,
    ratio_spread,
    spread_text,
    timed,
    unpooled,
    write_results_to,
)
from benchmarks.lib.memory import held_bytes, peak_rss_delta, saved_bytes

IN_FEATURES, OUT_FEATURES = 768, 3072
BASE = {"batch": 1024, "rank": 16, "d": 3}
SWEEPS = {
    "batch": (1, 4, 16, 64, 256, 1024, 4096, 16384),
    "rank": (4, 8, 16, 32, 64),
    "d": (2, 3, 4),
}
QUICK = {"batch": (16, 1024), "rank": (8, 32), "d": (2, 3)}
SMOKE = {"batch": (4, 64), "rank": (4,), "d": (2,)}
SMOKE_BASE = {"batch": 64, "rank": 4, "d": 2}
POINT_BUDGET_S = 6.0  # timed seconds per point: fewer repeats where one call is slow
MIB = 2**20


def tt_layer(rank: int, d: int, cache: str) -> comera.TTLinear:
    """The TT layer of a point, planning into (and from) the disk cache ``cache``."""
    torch.manual_seed(0)
    layer = comera.TTLinear(IN_FEATURES, OUT_FEATURES, ranks=rank, d=d)
    layer.compile_options = {"disk_cache": cache}
    return layer


def measure_point(batch: int, rank: int, d: int, repeats: int, warmup: int, cache: str) -> dict:
    """Time and memory of TT vs dense at one (B, rank, d)."""
    tt = tt_layer(rank, d, cache)
    torch.manual_seed(0)
    dense = nn.Linear(IN_FEATURES, OUT_FEATURES)
    x = torch.randn(batch, IN_FEATURES, requires_grad=True)
    dy = torch.randn(batch, OUT_FEATURES)
    layers = {"tt": tt, "dense": dense}

    def call(layer: nn.Module):
        def run() -> None:  # its own gradients allocated and freed within the call
            layer(x).backward(dy)
            x.grad = None
            for p in layer.parameters():
                p.grad = None
        return run

    calls = {name: call(layer) for name, layer in layers.items()}
    one = timed(lambda: [fn() for fn in calls.values()]).seconds  # one call of each
    repeats = max(3, min(repeats, int(POINT_BUDGET_S / max(one, 1e-6))))
    times = interleaved_times(calls, repeats, warmup)
    memory = {}
    with unpooled(tt):
        for name, layer in layers.items():
            params = sum(p.numel() * p.element_size() for p in layer.parameters())
            hooks = saved_bytes(lambda layer=layer: layer(x))
            memory[name] = {
                "params_mib": params / MIB,
                "peak_alloc_mib": (params + peak_allocated_bytes(calls[name])) / MIB,
                "saved_mib": hooks["saved"] / MIB, "output_mib": hooks["output"] / MIB,
                "held_mib": held_bytes(lambda layer=layer: layer(x)) / MIB,
                "rss_delta_mib": _mib_or_none(peak_rss_delta(calls[name])),
            }
    return {"batch": batch, "rank": rank, "d": d, "in_modes": list(tt.in_modes),
            "out_modes": list(tt.out_modes), "ranks": list(tt.ranks),
            "tt_params": sum(c.numel() for c in tt.cores), "repeats": repeats,
            "ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
            "dense_over_tt": ratio_spread(times["dense"], times["tt"]), "memory": memory}


def _mib_or_none(n: int | None) -> float | None:
    return None if n is None else n / MIB


def measure_planning(d: int, rank: int, batch: int) -> dict:
    """Cold plan of the d-core layer: empty disk cache, in-memory caches cleared."""
    with tempfile.TemporaryDirectory() as cache:
        tncomp.clear_cache()
        layer = tt_layer(rank, d, cache)
        table, plan_s, _ = timed(lambda: layer.compiled().regimes())
        x = torch.randn(batch, IN_FEATURES, requires_grad=True)
        first = timed(lambda: layer(x).sum().backward()).seconds
    return {"d": d, "rank": rank, "batch": batch, "plan_s": plan_s, "first_call_s": first,
            "regimes": len(table.regimes), "in_modes": list(layer.in_modes),
            "out_modes": list(layer.out_modes)}


def crossover(points: list[dict], key: str) -> dict:
    """Where TT stops beating dense along a sweep: the swept values where dense is faster
    (or smaller), and the first one."""
    slower = [p[key] for p in points if p["ms"]["tt"] > p["ms"]["dense"]]
    larger = [p[key] for p in points
              if p["memory"]["tt"]["peak_alloc_mib"] > p["memory"]["dense"]["peak_alloc_mib"]]
    return {"tt_slower_at": slower, "tt_larger_at": larger}


def run(sweeps: dict, base: dict, repeats: int, warmup: int) -> dict:
    """Every sweep's points (a point shared by two sweeps is measured once), and planning."""
    measured: dict[tuple, dict] = {}
    out: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as cache:
        for key, values in sweeps.items():
            out[key] = []
            for value in values:
                point = {**base, key: value}
                ident = (point["batch"], point["rank"], point["d"])
                if ident not in measured:
                    measured[ident] = measure_point(*ident, repeats, warmup, cache)
                    p = measured[ident]
                    print(f"B={p['batch']} rank={p['rank']} d={p['d']}: TT {p['ms']['tt']:.2f} ms"
                          f", dense {p['ms']['dense']:.2f} ms, "
                          f"{spread_text(p['dense_over_tt'])}", flush=True)
                out[key].append(measured[ident])
    measure_planning(2, 2, 4)  # warm: imports and first-use setup are not planning
    planning = [measure_planning(d, base["rank"], base["batch"]) for d in sweeps["d"]]
    for p in planning:
        print(f"planning d={p['d']}: {p['plan_s']:.2f} s, first call {p['first_call_s']:.2f} s",
              flush=True)
    return {"sweeps": out, "crossover": {k: crossover(v, k) for k, v in out.items()},
            "planning": planning}


def plot(payload: dict, path: Path) -> None:
    """Time (top) and memory (bottom) per sweep, TT and dense side by side; the points where
    dense wins are shaded; planning time per d in the last column."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    sweeps, base = payload["sweeps"], payload["base"]
    fig, axes = plt.subplots(2, 4, figsize=(17, 7.5))
    labels = {"batch": "batch B", "rank": "TT rank", "d": "cores d (per side)"}
    for col, (key, points) in enumerate(sweeps.items()):
        xs = [p[key] for p in points]
        fixed = ", ".join(f"{k}={v}" for k, v in base.items() if k != key)
        time_ax, mem_ax = axes[0][col], axes[1][col]
        for name, color in (("tt", "C0"), ("dense", "C3")):
            time_ax.plot(xs, [p["ms"][name] for p in points], "o-", color=color,
                         label="TT" if name == "tt" else "dense")
            mem_ax.plot(xs, [p["memory"][name]["peak_alloc_mib"] for p in points], "o-",
                        color=color, label=("TT" if name == "tt" else "dense")
                        + ": params + peak allocated")
            rss = [p["memory"][name]["rss_delta_mib"] for p in points]
            if key == "batch":  # log axis: a zero delta (pages the allocator reused) is a gap
                rss = [v if v else float("nan") for v in rss]
            if all(v is not None for v in rss):
                mem_ax.plot(xs, rss, "x--", color=color, alpha=0.6,
                            label=("TT" if name == "tt" else "dense")
                            + ": peak RSS delta")
        for ax, slower in ((time_ax, "tt_slower_at"), (mem_ax, "tt_larger_at")):
            for v in payload["crossover"][key][slower]:
                ax.axvspan(_below(xs, v), _above(xs, v), color="grey", alpha=0.15, lw=0)
            if key != "d":
                ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(v) for v in xs], fontsize=7)
            if key == "batch":  # decades apart: log axes; the other sweeps stay within one
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
                ax.yaxis.set_minor_formatter(ticker.NullFormatter())
            else:
                ax.set_ylim(bottom=0)
            ax.set_xlabel(labels[key])
            ax.grid(alpha=0.3, which="both")
        time_ax.set_title(f"time vs {labels[key]} ({fixed})", fontsize=9)
        mem_ax.set_title(f"memory vs {labels[key]} (shaded: dense wins)", fontsize=9)
        time_ax.set_ylabel("fwd+bwd ms")
        mem_ax.set_ylabel("MiB")
        time_ax.legend(fontsize=7)
        mem_ax.legend(fontsize=6)
    plan = payload["planning"]
    ds = [p["d"] for p in plan]
    axes[0][3].bar([str(d) for d in ds], [p["plan_s"] for p in plan], color="C0")
    axes[0][3].set_title(f"cold planning (rank {base['rank']})", fontsize=9)
    axes[0][3].set_ylabel("seconds")
    axes[0][3].set_xlabel("cores d (per side)")
    axes[1][3].bar([str(d) for d in ds], [p["first_call_s"] for p in plan], color="C2")
    axes[1][3].set_title(f"first fwd+bwd after planning (B={base['batch']})", fontsize=9)
    axes[1][3].set_ylabel("seconds")
    axes[1][3].set_xlabel("cores d (per side)")
    m = payload["machine"]
    fig.suptitle(f"TTLinear {IN_FEATURES}x{OUT_FEATURES} vs nn.Linear, fwd+bwd, "
                 f"{m['threads']} thread(s), {m['cpu']}, commit {m['commit']} "
                 f"({payload['mode']} mode)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _below(xs: list, v) -> float:
    """Left edge of the shaded band around ``v``: halfway (geometrically) to the previous x."""
    i = xs.index(v)
    return v if i == 0 else (xs[i - 1] * v) ** 0.5


def _above(xs: list, v) -> float:
    i = xs.index(v)
    return v if i == len(xs) - 1 else (xs[i + 1] * v) ** 0.5


def render_markdown(payload: dict) -> str:
    """One table per sweep and the planning table."""
    m = payload["machine"]
    parts = [
        "# How the cost of a TT linear layer grows: batch, rank, cores (CPU)",
        "",
        f"torch {m['torch']}, {m['cpu']} ({m['cores']} cores), {m['threads']} thread(s), commit "
        f"{m['commit']}, {m['date']}; {payload['mode']} mode. TTLinear({IN_FEATURES}, "
        f"{OUT_FEATURES}) vs nn.Linear, forward + backward, input requiring grad; base point "
        + ", ".join(f"{k}={v}" for k, v in payload["base"].items())
        + ". Median of interleaved repeats; dense/TT time ratio with the quartiles and range "
        "of its per-round ratios. Memory in MiB: **alloc** = parameters + the profiler's peak "
        "allocated during one call (tncomp pooling off; plotted); **saved** = autograd's "
        "saved-tensor hooks (unique storages, input and weights included; tncomp's "
        "intermediates live on the autograd context and are not seen there); **held** = bytes "
        "allocated in the forward still live after it (output + everything kept for backward); "
        "**RSS** = the process's peak resident set during one call above the one before it "
        "(what a user sees; noise below a few tens of MiB). Load average (1 min) "
        f"{payload['load'][0]:.1f} at the start, {payload['load'][1]:.1f} at the end, on "
        f"{m['cores']} cores: above about 1, other jobs shared the machine and the spreads "
        "widen (treat single ratios near 1 with care). Plot: growth_cpu.png.",
    ]
    for key, points in payload["sweeps"].items():
        rows = []
        for p in points:
            tt, dn = p["memory"]["tt"], p["memory"]["dense"]
            rows.append([p[key], "x".join(map(str, p["in_modes"])) + " -> "
                         + "x".join(map(str, p["out_modes"])), f"{p['ms']['tt']:.2f}",
                         f"{p['ms']['dense']:.2f}", spread_text(p["dense_over_tt"]),
                         f"{tt['peak_alloc_mib']:.1f} / {dn['peak_alloc_mib']:.1f}",
                         f"{tt['saved_mib']:.1f} / {dn['saved_mib']:.1f}",
                         f"{tt['held_mib']:.1f} / {dn['held_mib']:.1f}",
                         f"{_fmt(tt['rss_delta_mib'])} / {_fmt(dn['rss_delta_mib'])}"])
        cross = payload["crossover"][key]
        parts += ["", f"## vs {key}", "",
                  markdown_table([key, "modes", "TT ms", "dense ms", "dense / TT time",
                                  "alloc TT / dense", "saved TT / dense", "held TT / dense",
                                  "RSS TT / dense"], rows),
                  "", f"TT slower than dense at {key} = {_list(cross['tt_slower_at'])}; "
                  f"TT uses more memory (alloc) at {key} = {_list(cross['tt_larger_at'])}."]
    rows = [[p["d"], "x".join(map(str, p["in_modes"])) + " -> "
             + "x".join(map(str, p["out_modes"])), f"{p['plan_s']:.3f}",
             f"{p['first_call_s']:.3f}", p["regimes"]] for p in payload["planning"]]
    parts += ["", "## Cold planning per d", "",
              f"Rank {payload['base']['rank']}, first call at B={payload['base']['batch']}; "
              "empty disk-cache directory, `tncomp.clear_cache()` before each; in one process "
              "after a warm-up plan of another layer.", "",
              markdown_table(["d", "modes", "plan s", "first fwd+bwd s", "regimes"], rows)]
    return "\n".join(parts)


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def _list(values: list) -> str:
    return ", ".join(map(str, values)) if values else "none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two points per sweep")
    parser.add_argument("--smoke", action="store_true",
                        help="quickest run: tiny sweeps, one repeat; checks the script")
    parser.add_argument("--repeats", type=int, default=15,
                        help="most repeats per point (fewer where a call is slow)")
    parser.add_argument("--threads", type=int, default=1)
    add_out(parser, "growth_cpu")
    args = parser.parse_args(argv)
    check_at_least_one(parser, args, "repeats", "threads")
    sweeps = SMOKE if args.smoke else QUICK if args.quick else SWEEPS
    base = SMOKE_BASE if args.smoke else BASE
    repeats = 1 if args.smoke else 5 if args.quick else args.repeats
    load_start = os.getloadavg()[0]
    with num_threads(args.threads):
        result = run(sweeps, base, repeats, 1 if args.smoke else 2)
        payload = {**run_header(args), "base": base,
                   "load": [load_start, os.getloadavg()[0]],
                   "note_spread": "dense_over_tt: the ratio of medians, and the quartiles and "
                                  "range of the per-round ratios of interleaved repeats",
                   **result}
    markdown = render_markdown(payload)
    json_path, md_path = write_results_to(args.out, payload, markdown)
    png_path = md_path.with_suffix(".png")
    plot(payload, png_path)
    print(markdown)
    print(f"wrote {json_path}, {md_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
