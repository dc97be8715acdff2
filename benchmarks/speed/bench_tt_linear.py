"""Forward+backward of one TT linear layer: tncomp vs dense, hand-derived CoMERA and peers.

All methods run side by side in one process, timed round-robin (median of repeats after
warm-up, with the spread of the per-round ratios). Reports time, ratios, FLOPs, measured peak
memory, time over the plan's floor (FLOPs at the measured square-GEMM rate / bytes at the
measured bandwidth) and over its shape floor (each GEMM at the measured rate of its own shape
class, the calibration's table), and the per-call cost of a cached plan. Writes
benchmarks/results/tt_linear_cpu.{json,md}.

    python -m benchmarks.speed.bench_tt_linear            # full
    python -m benchmarks.speed.bench_tt_linear --quick    # fewer repeats and cases
    python -m benchmarks.speed.bench_tt_linear --smoke --out /tmp/tt   # one repeat, smallest case
    python -m benchmarks.speed.bench_tt_linear --device cuda   # on a GPU: tt_linear_cuda.{json,md}

On CUDA every timed call ends with ``torch.cuda.synchronize()``, peak memory is the caching
allocator's ``max_memory_allocated`` above what was allocated before the call, and a
``tncomp_cuda_graphs`` variant replays the same plan from captured CUDA graphs.
"""

from __future__ import annotations

import argparse
import math
import statistics
import string
import sys

import torch

import tncomp
from benchmarks.lib.baselines import (
    dense_linear,
    hand_derived_comera,
    make_cores,
    naive_core_by_core,
    opt_einsum_optimal,
    tensorly_torch_tt,
)
from benchmarks.lib.cli import add_out, check_at_least_one, run_header
from benchmarks.lib.measure import (
    interleaved_times,
    markdown_table,
    publish,
    ratio_spread,
    smoke_device_model,
    spread_text,
    square_rate_model,
)
from comera.experiments import step_cost
from tncomp.runtime.device_timing import calibrate

CASES = [  # (label, in_modes, out_modes, max rank)
    ("768x3072 d=3", (12, 8, 8), (12, 16, 16), 30),
    ("768x768 d=3", (12, 8, 8), (8, 8, 12), 30),
    ("768x3072 d=2", (24, 32), (48, 64), 30),
    ("768x3072 d=4", (4, 4, 6, 8), (4, 8, 8, 12), 30),
]
BATCHES = (128, 4096)
SMOKE_CASE = ("768x768 d=3", (12, 8, 8), (8, 8, 12), 30)


def tltorch_rank_like(in_modes, out_modes, n_params: int) -> int:
    """The largest uniform TT-matrix rank whose parameter count stays within ours."""
    best = 1
    for r in range(1, 65):
        ranks = [1] + [r] * (len(in_modes) - 1) + [1]
        count = sum(ranks[k] * i * o * ranks[k + 1]
                    for k, (i, o) in enumerate(zip(in_modes, out_modes, strict=True)))
        if count <= n_params:
            best = r
    return best


def synchronized(fn, device: torch.device):
    """``fn`` followed by a device synchronization on CUDA (so a timer sees the work done)."""
    if device.type != "cuda":
        return fn

    def call():
        fn()
        torch.cuda.synchronize(device)

    return call


def peak_bytes(fn, device: torch.device) -> int:
    """Peak bytes allocated during one call of ``fn`` above what was live before it, after a
    warm-up call (:func:`comera.experiments.step_cost.peak_allocated_bytes`: the CPU profiler's
    allocation events, or the CUDA caching allocator's statistics)."""
    fn()  # warm: steady-state allocations only
    return step_cost.peak_allocated_bytes(fn, device)


def run_case(label, in_modes, out_modes, rank, batch, repeats, model, slow_baselines,
             warmup=3, device="cpu"):
    device = torch.device(device)
    torch.manual_seed(0)
    n_in, n_out = math.prod(in_modes), math.prod(out_modes)
    ranks = tncomp.resolve_ranks(rank, in_modes + out_modes)
    cores = make_cores(in_modes, out_modes, ranks, device=device)
    n_params = sum(c.numel() for c in cores)
    x = torch.randn(batch, n_in, device=device, requires_grad=True)
    dy = torch.randn(batch, n_out, device=device)
    compiled = tncomp.compile(tncomp.tt_linear(in_modes, out_modes, ranks), disk_cache=False)
    x_modes = x.detach().view(batch, *in_modes).requires_grad_()
    dy_modes = dy.view(batch, *out_modes)

    def tncomp_step():
        compiled(x_modes, *cores).backward(dy_modes)

    methods = {"tncomp": tncomp_step}
    if device.type == "cuda":
        graphed = tncomp.compile(compiled.network, disk_cache=False, cuda_graphs=True)
        methods["tncomp_cuda_graphs"] = lambda: graphed(x_modes, *cores).backward(dy_modes)
    baselines = [hand_derived_comera(cores, in_modes, out_modes),
                 dense_linear(n_in, n_out, device=device)]
    if slow_baselines:
        baselines += [naive_core_by_core(cores, in_modes, out_modes),
                      opt_einsum_optimal(cores, in_modes, out_modes, batch),
                      tensorly_torch_tt(in_modes, out_modes,
                                        tltorch_rank_like(in_modes, out_modes, n_params))]
    for b in baselines:
        methods[b.name] = (lambda b=b: b.run(x, dy))
    methods = {name: synchronized(fn, device) for name, fn in methods.items()}
    times = interleaved_times(methods, repeats, warmup)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    # Pooled buffers live between calls and would not show as new allocations: measure the
    # same plan with pooling off, so every byte it uses is counted.
    unpooled = tncomp.compile(compiled.network, disk_cache=False, pool_buffers=False)
    memory_fns = {**methods, "tncomp": lambda: unpooled(x_modes, *cores).backward(dy_modes)}
    peaks = {name: peak_bytes(fn, device) for name, fn in memory_fns.items()}
    for c in cores:
        c.grad = None

    sizes = {"b": batch}
    plan = compiled.plan_for({**{i: s for i, s in compiled.network.sizes
                                 if isinstance(s, int)}, **sizes}, (True,) * (len(cores) + 1),
                             device=device)
    square = square_rate_model(model)
    floor, shape_floor = plan.floor_time(square), plan.floor_time(model)
    dense_flops = 3 * 2 * batch * n_in * n_out
    t = medians["tncomp"]
    return {
        "case": label, "batch": batch, "in_modes": in_modes, "out_modes": out_modes,
        "ranks": ranks, "tt_params": n_params, "dense_params": n_in * n_out,
        "ms": {k: v * 1e3 for k, v in medians.items()},
        "note_peak": "peak bytes allocated during one fwd+bwd (tncomp measured unpooled)",
        "peak_mb": {k: v / 2**20 for k, v in peaks.items()},
        "speedup_vs_dense": medians["dense"] / t,
        "speedup_vs_hand": medians["hand_derived_comera"] / t,
        "spread": {"vs_dense": ratio_spread(times["dense"], times["tncomp"]),
                   "vs_hand": ratio_spread(times["hand_derived_comera"], times["tncomp"]),
                   # every method's time over tncomp's, each with its spread
                   **{f"{name}_vs_tncomp": ratio_spread(ts, times["tncomp"])
                      for name, ts in times.items() if name != "tncomp"}},
        "plan_flops": plan.forward_flops + plan.backward_flops, "dense_flops": dense_flops,
        "plan_floor_ms": floor * 1e3, "over_floor": t / floor,
        "plan_shape_floor_ms": shape_floor * 1e3, "over_shape_floor": t / shape_floor,
        "tree": tncomp.describe_tree(compiled.network, plan.tree),
        "descriptions": {b.name: b.description for b in baselines},
    }


def device_name(device: str) -> str:
    """The device the numbers come from, in words (the GPU's name on CUDA)."""
    return torch.cuda.get_device_name() if device == "cuda" else "CPU"


def dispatch_overhead(repeats: int = 2000) -> dict:
    """Per-call cost of a cached plan on a tiny network (2x2 modes, rank 2), where the
    arithmetic is negligible: the call is almost all lookup, wrapper and dispatch. Next to it,
    ``torch.einsum`` on the same operands, and both again with autograd."""
    net = tncomp.tt_linear((2, 2), (2, 2), 2)
    f = tncomp.compile(net, disk_cache=False)
    ops = [torch.randn(1, 2, 2)] + [torch.randn(*(s for s in net.shape(t)))
                                    for t in net.operands[1:]]
    letter = {index: string.ascii_letters[k] for k, (index, _) in enumerate(net.sizes)}
    eq = (",".join("".join(letter[i] for i in t.indices) for t in net.operands) + "->"
          + "".join(letter[i] for i in net.output.indices))

    grad_ops = [o.clone().requires_grad_() for o in ops]
    calls = {"call": lambda: f(*ops), "einsum": lambda: torch.einsum(eq, *ops),
             "call_with_autograd": lambda: f(*grad_ops),
             "einsum_with_autograd": lambda: torch.einsum(eq, *grad_ops)}
    # five interleaved rounds of ``repeats`` calls each: the median round's time per call
    times = interleaved_times(calls, 5, min(200, repeats), inner=repeats)
    return {f"{name}_us": statistics.median(ts) * 1e6 for name, ts in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases and repeats")
    parser.add_argument("--smoke", action="store_true",
                        help="quickest run: smallest case, B=128, one repeat, default device "
                             "model (no calibration); checks the script, measures nothing")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where to run (cuda: synchronized timing, the allocator's peak, "
                             "and a CUDA-graphs variant)")
    add_out(parser, None, "default tt_linear_<device>")
    args = parser.parse_args(argv)
    check_at_least_one(parser, args, "repeats")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device here; run it on a machine "
                     "with a GPU, or use --device cpu")
    model = smoke_device_model() if args.smoke else calibrate(args.device, save=False, shapes=True)
    print(f"device model ({model.source}): GEMM {model.gemm_flops_per_s / 1e9:.1f} GFLOP/s, "
          f"bandwidth {model.bytes_per_s / 1e9:.1f} GB/s, "
          f"step {model.step_overhead_s * 1e6:.1f} us")
    cases = [SMOKE_CASE] if args.smoke else CASES[:1] if args.quick else CASES
    batches = BATCHES[:1] if args.smoke else BATCHES
    results = []
    for label, in_modes, out_modes, rank in cases:
        for batch in batches:
            repeats = args.repeats or (1 if args.smoke else 5 if args.quick
                                       else 9 if batch > 1000 else 25)
            slow = not (args.quick or args.smoke) and label == CASES[0][0]
            r = run_case(label, in_modes, out_modes, rank, batch, repeats, model, slow,
                         warmup=1 if args.smoke else 3, device=args.device)
            results.append(r)
            print(f"{label} B={batch}: tncomp {r['ms']['tncomp']:.2f} ms, "
                  f"{spread_text(r['spread']['vs_dense'])} dense, "
                  f"{spread_text(r['spread']['vs_hand'])} hand, {r['over_floor']:.2f}x floor")
    overhead = dispatch_overhead(20 if args.smoke else 2000)
    print(f"cached plan call: {overhead['call_us']:.1f} us (torch.einsum "
          f"{overhead['einsum_us']:.1f} us); with autograd {overhead['call_with_autograd_us']:.1f}"
          f" us (einsum {overhead['einsum_with_autograd_us']:.1f} us)")
    payload = {**run_header(args), "device": device_name(args.device), "model": {
        "source": model.source, "gemm_gflops": model.gemm_flops_per_s / 1e9,
        "bandwidth_gbs": model.bytes_per_s / 1e9},
        "note_spread": "spread: the ratio of medians, and the quartiles (q1, q3) and range of "
                       "the per-round ratios of interleaved repeats",
        "results": results, "dispatch_overhead": overhead}
    return publish(args.out or f"tt_linear_{args.device}", payload, render_markdown(payload))


def render_markdown(payload: dict) -> str:
    """The results as a markdown table: times, ratios with their spread, floor and memory."""
    rows = []
    for r in payload["results"]:
        others = " / ".join(f"{k} {v:.1f} ({spread_text(r['spread'][k + '_vs_tncomp'])})"
                            for k, v in r["ms"].items()
                            if k not in ("tncomp", "dense", "hand_derived_comera"))
        rows.append([r["case"], r["batch"], f"{r['ms']['tncomp']:.2f}",
                     f"{r['ms']['hand_derived_comera']:.2f}", f"{r['ms']['dense']:.1f}",
                     spread_text(r["spread"]["vs_dense"]), spread_text(r["spread"]["vs_hand"]),
                     f"{r['over_floor']:.2f}x", f"{r['over_shape_floor']:.2f}x",
                     f"{r['peak_mb']['tncomp']:.1f} / "
                     f"{r['peak_mb']['hand_derived_comera']:.1f} / {r['peak_mb']['dense']:.1f}",
                     others or "-"])
    m, model, overhead = payload["machine"], payload["model"], payload["dispatch_overhead"]
    return "\n".join([
        f"# TT linear layer, forward + backward ({payload.get('device', 'CPU')})",
        "",
        f"torch {m['torch']}, {m['cpu']} ({m['cores']} cores), {m['threads']} threads, commit "
        f"{m['commit']}, {m['date']}; {payload['mode']} mode. Device model {model['source']}: "
        f"GEMM {model['gemm_gflops']:.1f} GFLOP/s, bandwidth {model['bandwidth_gbs']:.1f} GB/s. "
        "Median of interleaved repeats after warm-up; each ratio with the quartiles and range "
        "of its per-round ratios; ratios within one run. The floor takes every GEMM at the "
        "square GEMM's rate; the shape floor at the measured rate of its own shape class.",
        "",
        markdown_table(["layer", "B", "tncomp ms", "hand-derived ms", "dense ms",
                        "vs dense", "vs hand", "time / floor", "time / shape floor",
                        "peak MiB tncomp / hand / dense",
                        "other baselines: ms (time / tncomp's)"], rows),
        "",
        f"A cached plan's call on a tiny network (2x2 modes, rank 2: almost all dispatch): "
        f"{overhead['call_us']:.1f} us (torch.einsum {overhead['einsum_us']:.1f} us); with "
        f"autograd {overhead['call_with_autograd_us']:.1f} us (einsum "
        f"{overhead['einsum_with_autograd_us']:.1f} us).",
    ])


if __name__ == "__main__":
    sys.exit(main())
