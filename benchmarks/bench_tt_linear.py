"""Forward+backward of one TT linear layer: tncomp vs dense, hand-derived CoMERA and peers.

All methods run side by side in one process, timed round-robin (median of repeats after
warm-up). Reports time, ratios, FLOPs, measured peak memory, time over the plan's floor
(FLOPs at the measured GEMM rate / bytes at the measured bandwidth), and the dispatch overhead
of a cached plan. Writes benchmarks/results/tt_linear_cpu.{json,md}.

    python benchmarks/bench_tt_linear.py            # full
    python benchmarks/bench_tt_linear.py --quick    # fewer repeats and cases
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from baselines import (
    dense_linear,
    hand_derived_comera,
    make_cores,
    naive_core_by_core,
    opt_einsum_optimal,
    tensorly_torch_tt,
)
from harness import (
    interleaved_medians,
    machine_info,
    markdown_table,
    peak_allocated_bytes,
    write_results,
)

import tncomp
from tncomp.runtime.calibrate import calibrate

CASES = [  # (label, in_modes, out_modes, max rank)
    ("768x3072 d=3", (12, 8, 8), (12, 16, 16), 30),
    ("768x768 d=3", (12, 8, 8), (8, 8, 12), 30),
    ("768x3072 d=2", (24, 32), (48, 64), 30),
    ("768x3072 d=4", (4, 4, 6, 8), (4, 8, 8, 12), 30),
]
BATCHES = (128, 4096)


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


def run_case(label, in_modes, out_modes, rank, batch, repeats, model, slow_baselines):
    torch.manual_seed(0)
    n_in, n_out = math.prod(in_modes), math.prod(out_modes)
    ranks = tncomp.resolve_ranks(rank, in_modes + out_modes)
    cores = make_cores(in_modes, out_modes, ranks)
    n_params = sum(c.numel() for c in cores)
    x = torch.randn(batch, n_in, requires_grad=True)
    dy = torch.randn(batch, n_out)
    compiled = tncomp.compile(tncomp.tt_linear(in_modes, out_modes, ranks), disk_cache=False)
    x_modes = x.detach().view(batch, *in_modes).requires_grad_()
    dy_modes = dy.view(batch, *out_modes)

    def tncomp_step():
        compiled(x_modes, *cores).backward(dy_modes)

    methods = {"tncomp": tncomp_step}
    baselines = [hand_derived_comera(cores, in_modes, out_modes), dense_linear(n_in, n_out)]
    if slow_baselines:
        baselines += [naive_core_by_core(cores, in_modes, out_modes),
                      opt_einsum_optimal(cores, in_modes, out_modes, batch),
                      tensorly_torch_tt(in_modes, out_modes,
                                        tltorch_rank_like(in_modes, out_modes, n_params))]
    for b in baselines:
        methods[b.name] = (lambda b=b: b.run(x, dy))
    medians = interleaved_medians(methods, repeats)
    # Pooled buffers live between calls and would not show as new allocations: measure the
    # same plan with pooling off, so every byte it uses is counted.
    unpooled = tncomp.compile(compiled.network, disk_cache=False, pool_buffers=False)
    memory_fns = {**methods, "tncomp": lambda: unpooled(x_modes, *cores).backward(dy_modes)}
    peaks = {name: peak_allocated_bytes(fn) for name, fn in memory_fns.items()}
    for c in cores:
        c.grad = None

    sizes = {"b": batch}
    plan = compiled.plan_for({**{i: s for i, s in compiled.network.sizes
                                 if isinstance(s, int)}, **sizes}, (True,) * (len(cores) + 1))
    floor = plan.floor_time(model)
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
        "plan_flops": plan.forward_flops + plan.backward_flops, "dense_flops": dense_flops,
        "plan_floor_ms": floor * 1e3, "over_floor": t / floor,
        "tree": tncomp.describe_tree(compiled.network, plan.tree),
        "descriptions": {b.name: b.description for b in baselines},
    }


def dispatch_overhead(repeats: int = 2000) -> dict:
    """Per-call cost tncomp adds on a cached plan: lookup + wrapper, without/with autograd."""
    net = tncomp.tt_linear((2, 2), (2, 2), 2)
    f = tncomp.compile(net, disk_cache=False)
    ops = [torch.randn(1, 2, 2)] + [torch.randn(*(s for s in net.shape(t)))
                                    for t in net.operands[1:]]
    f(*ops)
    runner = next(iter(f._local.values()))

    def per_call(fn):
        for _ in range(200):
            fn()
        best = math.inf
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            best = min(best, (time.perf_counter() - start) / repeats)
        return best

    raw = per_call(lambda: runner.code.forward(*ops))
    called = per_call(lambda: f(*ops))
    grad_ops = [o.clone().requires_grad_() for o in ops]
    f(*grad_ops)
    runner_g = f._local[tuple((t.shape, t.dtype, True) for t in grad_ops)]
    raw_g = per_call(lambda: runner_g.code.forward(*grad_ops))
    called_g = per_call(lambda: f(*grad_ops))
    return {"raw_forward_us": raw * 1e6, "call_us": called * 1e6,
            "overhead_us": (called - raw) * 1e6,
            "raw_forward_grad_plan_us": raw_g * 1e6, "call_with_autograd_us": called_g * 1e6,
            "overhead_with_autograd_us": (called_g - raw_g) * 1e6}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases and repeats")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    model = calibrate("cpu", save=False)
    print(f"calibrated: GEMM {model.gemm_flops_per_s / 1e9:.1f} GFLOP/s, bandwidth "
          f"{model.bytes_per_s / 1e9:.1f} GB/s, step {model.step_overhead_s * 1e6:.1f} us")
    cases = CASES[:1] if args.quick else CASES
    results = []
    for label, in_modes, out_modes, rank in cases:
        for batch in BATCHES:
            repeats = args.repeats or (5 if args.quick else (9 if batch > 1000 else 25))
            slow = not args.quick and label == CASES[0][0]
            r = run_case(label, in_modes, out_modes, rank, batch, repeats, model, slow)
            results.append(r)
            print(f"{label} B={batch}: tncomp {r['ms']['tncomp']:.2f} ms, "
                  f"{r['speedup_vs_dense']:.2f}x dense, {r['speedup_vs_hand']:.2f}x hand, "
                  f"{r['over_floor']:.2f}x floor")
    overhead = dispatch_overhead()
    print(f"dispatch overhead of a cached plan: {overhead['overhead_us']:.1f} us "
          f"(with autograd {overhead['overhead_with_autograd_us']:.1f} us)")
    payload = {"machine": machine_info(), "model": {
        "gemm_gflops": model.gemm_flops_per_s / 1e9, "bandwidth_gbs": model.bytes_per_s / 1e9},
        "results": results, "dispatch_overhead": overhead}
    rows = []
    for r in results:
        others = " / ".join(f"{k} {v:.1f}" for k, v in r["ms"].items()
                            if k not in ("tncomp", "dense", "hand_derived_comera"))
        rows.append([r["case"], r["batch"], f"{r['ms']['tncomp']:.2f}",
                     f"{r['ms']['hand_derived_comera']:.2f}", f"{r['ms']['dense']:.1f}",
                     f"**{r['speedup_vs_dense']:.2f}x**", f"**{r['speedup_vs_hand']:.2f}x**",
                     f"{r['over_floor']:.2f}x", f"{r['peak_mb']['tncomp']:.1f} / "
                     f"{r['peak_mb']['hand_derived_comera']:.1f} / {r['peak_mb']['dense']:.1f}",
                     others or "-"])
    m = payload["machine"]
    md = "\n".join([
        "# TT linear layer, forward + backward (CPU)",
        "",
        f"torch {m['torch']}, {m['cpu']}, {m['threads']} threads, commit {m['commit']}, "
        f"{m['date']}. Calibrated GEMM {payload['model']['gemm_gflops']:.1f} GFLOP/s, "
        f"bandwidth {payload['model']['bandwidth_gbs']:.1f} GB/s. Median of interleaved "
        "repeats after warm-up; ratios within one run.",
        "",
        markdown_table(["layer", "B", "tncomp ms", "hand-derived ms", "dense ms",
                        "vs dense", "vs hand", "time / floor",
                        "peak MiB tncomp / hand / dense", "other baselines (ms)"], rows),
        "",
        f"Dispatch overhead of a cached plan: {overhead['overhead_us']:.1f} us per call "
        f"(no grad), {overhead['overhead_with_autograd_us']:.1f} us with the autograd Function.",
    ])
    json_path, md_path = write_results("tt_linear_cpu", payload, md)
    print(md)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
