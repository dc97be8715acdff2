"""Every registered weight format at one budget: a 768x3072 layer with about 50x fewer parameters.

For each format of :func:`comera.formats.registry.format_names` the largest uniform rank whose
cores fit ``768 * 3072 / 50`` parameters is chosen; its ``GatedLinear`` (gates folded in, no
bias) and a dense ``nn.Linear`` (no bias) run forward + backward side by side in one process,
timed round-robin (median of repeats after warm-up, with the spread of the per-round ratios
against dense), at B=4096 and B=128. The backward gets a contiguous dY, as a next layer hands
it (a ``.sum()`` loss hands a stride-0 one, which costs a copy of its own).

The device model is measured first, in this process at its thread count (``tncomp calibrate``:
the GEMM rate of a square GEMM, the bandwidth of a plain copy, the slowdowns of a transpose and
a gather, and the GEMM-rate table over thin to square shapes); layers plan with its square rate
(the planner's default). Each plan has two roofline floors, sums over its steps of the step's
FLOPs at a GEMM rate or its bytes at that bandwidth, whichever is slower: at the square GEMM's
rate (strict: what no thin GEMM reaches) and at the measured rate of the step's own shape class
(what this BLAS can do for that shape; the floor the issue names). The table sets the measured
time beside both, and the JSON holds each step's measured time beside its floors
(:func:`tncomp.runtime.profile.measure_plan`), so the gap shows where it is. Reports
parameters, ranks, the plan's FLOPs and copy bytes, time, floor and measured peak memory.
Writes benchmarks/results/formats_cpu.{json,md}.

    python -m benchmarks.speed.bench_formats            # full
    python -m benchmarks.speed.bench_formats --quick    # fewer repeats
    python -m benchmarks.speed.bench_formats --smoke --out /tmp/formats   # B=128, one repeat
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys

import torch

import tncomp
from benchmarks.lib.baselines import dense_linear
from benchmarks.lib.cli import add_out, check_at_least_one, run_header
from benchmarks.lib.measure import (
    interleaved_times,
    markdown_table,
    peak_allocated_bytes,
    publish,
    ratio_spread,
    smoke_device_model,
    spread_text,
    square_rate_model,
)
from comera.formats.layout import Layout
from comera.formats.registry import Format, format_names, get_format
from comera.layers.linear import GatedLinear
from comera.ranks.budget import largest_rank, layout_size
from tncomp.runtime.device_timing import calibrate
from tncomp.runtime.profile import measure_plan

IN_MODES, OUT_MODES = (12, 8, 8), (12, 16, 16)  # 768 x 3072, as in bench_tt_linear
COMPRESSION = 50
BATCHES = (4096, 128)


def layout_at_budget(fmt: Format, budget: int) -> Layout:
    """The format's layout at the largest uniform int rank whose cores fit ``budget``
    parameters (:func:`comera.ranks.budget.largest_rank`)."""
    in_modes = IN_MODES if fmt.uses_modes else (768,)
    out_modes = OUT_MODES if fmt.uses_modes else (3072,)
    rank = largest_rank(lambda r: layout_size(fmt, in_modes, out_modes, r), budget, 3072)
    if rank < 1:
        raise SystemExit(f"format {fmt.name!r}: even rank 1 is above {budget} parameters")
    return fmt.layout(in_modes, out_modes, rank)


def run_batch(batch: int, repeats: int, warmup: int, model: tncomp.DeviceModel,
              step_repeats: int) -> list[dict]:
    """One row per format (and dense) at ``batch``, all timed in one interleaved loop; each
    format's plan (under ``model`` without its shape table) with its floors (square rate and
    ``model``'s shape-class rates) and per-step times."""
    square = square_rate_model(model)
    torch.manual_seed(0)
    n_in, n_out = 768, 3072
    budget = n_in * n_out // COMPRESSION
    x = torch.randn(batch, n_in, requires_grad=True)
    dy = torch.randn(batch, n_out)  # contiguous, as a next layer hands it
    dense = dense_linear(n_in, n_out)
    methods = {"dense": lambda: dense.run(x, dy)}
    memory_fns = dict(methods)
    dense_flops = 3 * 2 * batch * n_in * n_out
    dense_bytes = 4 * (batch * n_in + n_in * n_out + batch * n_out)  # each of its 3 GEMMs
    dense_floor = max(dense_flops / model.gemm_flops_per_s, 3 * dense_bytes / model.bytes_per_s)
    # y = x W^T, dx = dy W, dW = dy^T x: (m, n, k) of each
    dense_shape_floor = sum(model.matmul_floor(m, n, k, 1, dense_bytes) for m, n, k in
                            ((batch, n_out, n_in), (batch, n_in, n_out), (n_out, n_in, batch)))
    info = {"dense": {"params": n_in * n_out, "gates": 0, "ranks": None,
                      "plan_flops": dense_flops, "tree": "x @ W", "floor_ms": dense_floor * 1e3,
                      "shape_floor_ms": dense_shape_floor * 1e3, "copy_mb": 0.0}}
    for name in format_names():
        fmt = get_format(name)
        if not fmt.from_modes:  # a declared format has no layout of its own
            continue
        layout = layout_at_budget(fmt, budget)
        modes = {"in_modes": layout.in_modes, "out_modes": layout.out_modes} \
            if fmt.uses_modes else {}
        rank = max(layout.bond_sizes)  # the uniform int rank (capped per bond as chosen)
        layer = GatedLinear(n_in, n_out, format=name, ranks=rank, bias=False, **modes)
        assert layer.layout == layout, (layer.layout, layout)
        layer.compile_options["model"] = square  # plan with this machine's measured numbers
        layer.build_compiled()
        unpooled = copy.deepcopy(layer)
        unpooled.compile_options["pool_buffers"] = False
        unpooled.build_compiled()
        methods[name] = lambda m=layer: m(x).backward(dy)
        memory_fns[name] = lambda m=unpooled: m(x).backward(dy)
        net = layer.compiled().network
        sizes = {**{i: s for i, s in net.sizes if isinstance(s, int)}, "b": batch}
        plan = layer.compiled().plan_for(sizes, (True,) * len(net.operands))
        shapes = [tuple(sizes[i] for i in t.indices) for t in net.operands]
        info[name] = {"params": layout.parameters_at(layout.bond_sizes),
                      "gates": sum(layout.bond_sizes), "ranks": list(layout.bond_sizes),
                      "title": fmt.title,
                      "plan_flops": plan.forward_flops + plan.backward_flops,
                      "tree": tncomp.describe_tree(net, plan.tree),
                      "floor_ms": plan.floor_time(square) * 1e3,
                      "shape_floor_ms": plan.floor_time(model) * 1e3,
                      "copy_mb": plan.copy_bytes / 1e6,
                      "steps": step_rows(plan, measure_plan(plan, shapes, repeats=step_repeats),
                                         square, model)}
    times = interleaved_times(methods, repeats, warmup)
    peaks = {name: peak_allocated_bytes(fn) for name, fn in memory_fns.items()}
    rows = []
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        rows.append({"format": name, "batch": batch, **info[name],
                     "compression": n_in * n_out / info[name]["params"],
                     "ms": ms, "over_floor": ms / info[name]["floor_ms"],
                     "over_shape_floor": ms / info[name]["shape_floor_ms"],
                     "peak_mb": peaks[name] / 2**20,
                     "vs_dense": ratio_spread(times["dense"], ts)})
    return rows


def step_rows(plan, measured, square: tncomp.DeviceModel,
              shaped: tncomp.DeviceModel) -> list[dict]:
    """Every step of ``plan``: what it computes, its FLOPs and bytes, its floors under
    ``square`` and ``shaped`` (a model with a GEMM-rate table) and its measured median time."""
    rows = []
    for which, ops, times in (("fwd", plan.forward, measured.forward),
                              ("bwd", plan.backward, measured.backward)):
        for k, (op, t) in enumerate(zip(ops, times, strict=True)):
            rows.append({"pass": which, "step": k, "op": op.describe(), "note": op.note,
                         "mflop": op.flops / 1e6, "mb": op.nbytes / 1e6,
                         "floor_ms": square.step_floor(op) * 1e3,
                         "shape_floor_ms": shaped.step_floor(op) * 1e3, "ms": t * 1e3})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--smoke", action="store_true",
                        help="B=128 only, one repeat: checks the script, measures nothing")
    parser.add_argument("--repeats", type=int, default=None)
    add_out(parser, None, "default formats_cpu")
    args = parser.parse_args(argv)
    check_at_least_one(parser, args, "repeats")
    batches = BATCHES[1:] if args.smoke else BATCHES
    model = smoke_device_model() if args.smoke else calibrate("cpu", save=False, shapes=True)
    print(f"device model ({model.source}): GEMM {model.gemm_flops_per_s / 1e9:.1f} GFLOP/s, "
          f"bandwidth {model.bytes_per_s / 1e9:.1f} GB/s")
    results = []
    for batch in batches:
        repeats = args.repeats or (1 if args.smoke else 3 if args.quick
                                   else 9 if batch > 1000 else 25)
        rows = run_batch(batch, repeats, 1 if args.smoke or args.quick else 3, model,
                         1 if args.smoke else 3 if args.quick else 7)
        results += rows
        for r in rows:
            print(f"B={batch} {r['format']:>8}: {r['params']:>8} params "
                  f"({r['compression']:.1f}x), {r['ms']:.2f} ms "
                  f"({spread_text(r['vs_dense'])} dense), {r['over_floor']:.1f}x its floor "
                  f"{r['floor_ms']:.2f} ms, {r['over_shape_floor']:.1f}x its shape floor "
                  f"{r['shape_floor_ms']:.2f} ms, peak {r['peak_mb']:.1f} MiB")
    payload = {**run_header(args), "device": "CPU",
               "model": {"source": model.source, "gemm_gflops": model.gemm_flops_per_s / 1e9,
                         "bandwidth_gbs": model.bytes_per_s / 1e9,
                         "transpose_slowdown": model.transpose_slowdown,
                         "gather_slowdown": model.gather_slowdown},
               "note_floor": "floor_ms: the plan's roofline, each step's FLOPs at the measured "
                             "square-GEMM rate or its bytes at the measured copy bandwidth, "
                             "whichever is slower (dense: the same for its three GEMMs); "
                             "shape_floor_ms: the same with each GEMM at the measured rate of "
                             "its shape class (the model's table over (m, n, k), interpolated); "
                             "over_floor, over_shape_floor: measured ms over each; steps: each "
                             "step's floors and measured median (the plan alone, per-step "
                             "clock reads)",
               "note_dy": "the backward gets a contiguous dY, as a next layer hands it",
               "layer": {"in_features": 768, "out_features": 3072, "in_modes": IN_MODES,
                         "out_modes": OUT_MODES, "compression_target": COMPRESSION},
               "note_spread": "vs_dense: dense time over the format's (above 1: faster than "
                              "dense), with the quartiles and range of the per-round ratios",
               "note_peak": "peak bytes allocated during one fwd+bwd (tncomp unpooled)",
               "note_params": "core parameters (gates, one per bond slice, not counted)",
               "results": results}
    return publish(args.out or "formats_cpu", payload, render_markdown(payload))


def render_markdown(payload: dict) -> str:
    """The results as one markdown table, a row per (format, batch)."""
    rows = [[r["format"], r["batch"], r["params"], f"{r['compression']:.1f}x",
             "-" if r["ranks"] is None else ",".join(map(str, r["ranks"])),
             f"{r['plan_flops'] / 1e9:.2f}", f"{r['copy_mb']:.1f}", f"{r['ms']:.2f}",
             f"{r['floor_ms']:.2f}", f"{r['over_floor']:.1f}x", f"{r['shape_floor_ms']:.2f}",
             f"{r['over_shape_floor']:.1f}x", spread_text(r["vs_dense"]),
             f"{r['peak_mb']:.1f}"] for r in payload["results"]]
    m, layer, model = payload["machine"], payload["layer"], payload["model"]
    return "\n".join([
        f"# Weight formats at ~{layer['compression_target']}x, forward + backward "
        f"({payload['device']})",
        "",
        f"A {layer['in_features']}x{layer['out_features']} layer (modes {layer['in_modes']} x "
        f"{layer['out_modes']}), each format at the largest uniform rank within "
        f"1/{layer['compression_target']} of the dense parameters. torch {m['torch']}, "
        f"{m['cpu']} ({m['cores']} cores), {m['threads']} threads, commit {m['commit']}, "
        f"{m['date']}; {payload['mode']} mode. Median of interleaved repeats after warm-up; "
        "speed-up over dense with the quartiles and range of its per-round ratios; ratios "
        "within one run. The backward gets a contiguous dY. Plans use the device model "
        f"measured at the start ({model['source']}: GEMM {model['gemm_gflops']:.1f} GFLOP/s, "
        f"bandwidth {model['bandwidth_gbs']:.1f} GB/s); the floor is each step's FLOPs at "
        "that GEMM rate or its bytes at that bandwidth, whichever is slower, summed; the shape "
        "floor takes each GEMM at the measured rate of its own shape class instead (the "
        "calibration's table over (m, n, k)). The JSON has every step's floors and measured "
        "time.",
        "",
        markdown_table(["format", "B", "params", "compression", "ranks", "GFLOP fwd+bwd",
                        "copy MB", "ms", "floor ms", "time / floor", "shape floor ms",
                        "time / shape floor", "speed-up vs dense", "peak MiB"], rows),
    ])


if __name__ == "__main__":
    sys.exit(main())
