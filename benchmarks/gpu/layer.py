"""Part 2 of ``make gpu``: forward+backward of one TT linear layer against dense and the
official-style hand path, fp32 and bf16.

Cases: 768x3072 at max rank 30 (modes (12, 8, 8) x (12, 16, 16)) at 128 and 4,096 rows, and a
LLaMA-1B MLP shape, 2048x8192 at 8,192 tokens (modes (8, 16, 16) x (16, 16, 32), max rank 128:
27x fewer parameters than dense, over the 10x asked). Methods, on the same cores:

- ``tncomp``: the compiled network, eager executor;
- ``tncomp_cuda_graphs``: the same plan replayed from captured CUDA graphs (CUDA only);
- ``torch_compile``: ``torch.compile`` over the tncomp call (inductor, default mode);
- ``hand``: the official-style hand path (merge the cores into L and R, ``x @ L @ R`` with a
  hand-written GEMM backward; benchmarks/lib/baselines.hand_derived_comera);
- ``dense``: ``nn.Linear`` (cuBLAS on a GPU).

bf16 runs every method on bf16 inputs and weights (as a bf16 model would). The backward gets a
contiguous dY, as a next layer would hand it. Time: CUDA events, median of the repeats after
warm-up; memory: ``torch.cuda.max_memory_allocated`` during one call (the operands included).

Then the formats whose CPU plans issue 32 rebuilt (Tucker, BTT; TT beside them) at the formats
benchmark's 768x3072 layer, ~50x fewer parameters, 4,096 rows, fp32: tncomp eager, tncomp with
CUDA graphs, dense. Every tncomp case also records its plan's roofline floor under the device's
calibrated model (``tncomp.runtime.device_timing.calibrate``, measured at the start of the part:
each step's FLOPs at the square-GEMM rate or its bytes at the copy bandwidth, whichever is
slower) and its permute-copy bytes.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch

import tncomp
from benchmarks.gpu.common import (
    Deadline,
    PartWriter,
    guarded,
    part_main,
    peak_bytes,
    summary,
    time_ms,
)
from benchmarks.lib.baselines import dense_linear, hand_derived_comera, make_cores
from tncomp.runtime.device_timing import calibrate

CASES = (  # (label, in_modes, out_modes, max rank, rows)
    ("768x3072 r30", (12, 8, 8), (12, 16, 16), 30, (128, 4096)),
    ("llama1b 2048x8192 r128", (8, 16, 16), (16, 16, 32), 128, (8192,)),
)
SMOKE_CASES = (("64x128 r4", (4, 4, 4), (4, 4, 8), 4, (16,)),)
FORMAT_CASES = (  # (format, in_modes, out_modes, rank, rows): ~50x at 768x3072
    ("tucker", (12, 8, 8), (12, 16, 16), 6, 4096),
    ("btt", (12, 8, 8), (12, 16, 16), 1, 4096),
    ("tt", (12, 8, 8), (12, 16, 16), 40, 4096),
)
SMOKE_FORMAT_CASES = (("tucker", (2, 2, 2), (2, 2, 4), 2, 16), ("btt", (2, 2, 2), (2, 2, 4), 1, 16))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
METHODS = ("tncomp", "tncomp_cuda_graphs", "torch_compile", "hand", "dense")


def methods_for(in_modes, out_modes, rank: int, rows: int, dtype: torch.dtype,
                device: str, which: tuple[str, ...] = METHODS
                ) -> tuple[dict[str, Callable[[], object]], dict]:
    """The fwd+bwd of each method in ``which`` on one set of cores and one input, and the
    case's sizes."""
    ranks = tncomp.resolve_ranks(rank, tuple(in_modes) + tuple(out_modes))
    cores = make_cores(in_modes, out_modes, ranks, dtype=dtype, device=device)
    n_in, n_out = math.prod(in_modes), math.prod(out_modes)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, n_in, generator=gen).to(device, dtype).requires_grad_()
    dy = torch.randn(rows, n_out, generator=gen).to(device, dtype)
    x_modes = x.detach().view(rows, *in_modes).requires_grad_()
    dy_modes = dy.view(rows, *out_modes)
    network = tncomp.tt_linear(in_modes, out_modes, ranks)
    eager = tncomp.compile(network, disk_cache=False)
    fns: dict[str, Callable[[], object]] = {}
    if "tncomp" in which:
        fns["tncomp"] = lambda: eager(x_modes, *cores).backward(dy_modes)
    if "tncomp_cuda_graphs" in which and device.startswith("cuda"):
        graphed = tncomp.compile(network, disk_cache=False, cuda_graphs=True)
        fns["tncomp_cuda_graphs"] = lambda: graphed(x_modes, *cores).backward(dy_modes)
    if "torch_compile" in which:
        compiled = torch.compile(lambda xm, *cs: eager(xm, *cs), dynamic=False)
        fns["torch_compile"] = lambda: compiled(x_modes, *cores).backward(dy_modes)
    if "hand" in which:
        hand = hand_derived_comera(cores, in_modes, out_modes)
        fns["hand"] = lambda: hand.run(x, dy)
    if "dense" in which:
        dense = dense_linear(n_in, n_out, dtype=dtype, device=device)
        fns["dense"] = lambda: dense.run(x, dy)
    sizes = {"in": n_in, "out": n_out, "rows": rows, "ranks": list(ranks),
             "tt_params": sum(c.numel() for c in cores), "dense_params": n_in * n_out}
    sizes["param_ratio"] = sizes["dense_params"] / sizes["tt_params"]
    return fns, sizes


def plan_facts(compiled: tncomp.CompiledNetwork, operands, model) -> dict:
    """The plan a call with ``operands`` runs: its roofline floor under ``model`` (ms), its
    permute-copy bytes (MB) and its tree."""
    with torch.enable_grad():
        plan = compiled.plan_of(*operands)
    return {"floor_ms": plan.floor_time(model) * 1e3, "copy_mb": plan.copy_bytes / 1e6,
            "tree": tncomp.describe_tree(compiled.network, plan.tree)}


def format_methods(fmt: str, in_modes, out_modes, rank: int, rows: int, device: str, model
                   ) -> tuple[dict[str, Callable[[], object]], dict]:
    """fwd+bwd of one format's layer (random cores, fp32) through tncomp eager and CUDA
    graphs, and of dense, with the plan's floor and copies."""
    from comera.formats.registry import get_format

    layout = get_format(fmt).layout(in_modes, out_modes, rank)
    network = layout.network()
    sizes = {**dict(layout.sizes), "b": rows}
    gen = torch.Generator().manual_seed(1)
    operands = [torch.randn(tuple(sizes[i] for i in t.indices), generator=gen).mul_(0.3)
                .to(device).requires_grad_() for t in network.operands]
    dy = torch.randn(tuple(sizes[i] for i in network.output.indices), generator=gen).to(device)
    eager = tncomp.compile(network, disk_cache=False, model=model)
    fns: dict[str, Callable[[], object]] = {"tncomp": lambda: eager(*operands).backward(dy)}
    if device.startswith("cuda"):
        graphed = tncomp.compile(network, disk_cache=False, model=model, cuda_graphs=True)
        fns["tncomp_cuda_graphs"] = lambda: graphed(*operands).backward(dy)
    n_in, n_out = math.prod(in_modes), math.prod(out_modes)
    x = torch.randn(rows, n_in, generator=gen).to(device).requires_grad_()
    dense = dense_linear(n_in, n_out, device=device)
    fns["dense"] = lambda: dense.run(x, dy.reshape(rows, n_out))
    params = layout.parameters_at(layout.bond_sizes)
    facts = {"format": fmt, "rows": rows, "ranks": list(layout.bond_sizes), "params": params,
             "dense_params": n_in * n_out, "param_ratio": n_in * n_out / params,
             **plan_facts(eager, operands, model)}
    return fns, facts


def measure(fns: dict[str, Callable[[], object]], device: str, repeats: int,
            warmup: int) -> dict[str, dict]:
    """Per method: time and peak memory, or the error it raised (the others still run)."""
    out = {}
    for method, fn in fns.items():
        try:
            stats = summary(time_ms(fn, device, repeats, warmup))
            peak = peak_bytes(fn, device)
            stats["peak_mib"] = None if peak is None else peak / 2**20
        except Exception as exc:  # e.g. a capture refused: report it, go on
            stats = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        out[method] = stats
    return out


def ratios(methods: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Each method's speed-up over dense and over the hand path (where both were timed)."""
    ms = {m: s["ms"] for m, s in methods.items() if "ms" in s}
    return {f"speedup_vs_{ref}": {m: ms[ref] / t for m, t in ms.items()}
            for ref in ("dense", "hand") if ref in ms}


def run(writer: PartWriter, deadline: Deadline, args) -> None:
    """Every case without torch.compile first (quick), then torch.compile case by case (its
    first call compiles for a minute or so): a short budget keeps the main comparison."""
    device = args.device
    repeats = args.repeats or (1 if args.smoke else 20)
    warmup = 1 if args.smoke else 3
    plan = [(f"{label} B={rows} {dname}", in_modes, out_modes, rank, rows, dname)
            for dname, dtype in DTYPES.items()
            for label, in_modes, out_modes, rank, all_rows in (SMOKE_CASES if args.smoke
                                                                else CASES)
            for rows in all_rows]
    quick = tuple(m for m in METHODS if m != "torch_compile")
    model = calibrate(device, save=False)
    for name, in_modes, out_modes, rank, rows, dname in plan:

        def case(in_modes=in_modes, out_modes=out_modes, rank=rank, rows=rows,
                 dname=dname) -> dict:
            fns, sizes = methods_for(in_modes, out_modes, rank, rows, DTYPES[dname], device,
                                     quick)
            methods = measure(fns, device, repeats, warmup)
            return {**sizes, "dtype": dname, "methods": methods, **ratios(methods)}

        guarded(writer, deadline, name, 5 if args.smoke else 12, case)
    for fmt, in_modes, out_modes, rank, rows in (SMOKE_FORMAT_CASES if args.smoke
                                                 else FORMAT_CASES):

        def format_case(fmt=fmt, in_modes=in_modes, out_modes=out_modes, rank=rank,
                        rows=rows) -> dict:
            fns, facts = format_methods(fmt, in_modes, out_modes, rank, rows, device, model)
            methods = measure(fns, device, repeats, warmup)
            over = {m: s["ms"] / facts["floor_ms"] for m, s in methods.items()
                    if "ms" in s and m != "dense"}
            return {**facts, "dtype": "fp32", "methods": methods, "over_floor": over,
                    "model": model.source, **ratios(methods)}

        guarded(writer, deadline, f"format {fmt} B={rows} fp32", 5 if args.smoke else 10,
                format_case)
    done = {c["case"] for c in writer.payload["cases"]}
    for name, in_modes, out_modes, rank, rows, dname in plan:
        if name not in done:
            continue

        def compiled(name=name, in_modes=in_modes, out_modes=out_modes, rank=rank, rows=rows,
                     dname=dname) -> None:
            fns, _ = methods_for(in_modes, out_modes, rank, rows, DTYPES[dname], device,
                                 ("torch_compile",))
            writer.extend(name, "methods", measure(fns, device, repeats, warmup))
            case = next(c for c in writer.payload["cases"] if c["case"] == name)
            case.update(ratios(case["methods"]))
            writer.extend(name, "methods", {})  # save the ratios too

        guarded(writer, deadline, f"{name} torch.compile", 5 if args.smoke else 40, compiled)


def main(argv: list[str] | None = None) -> int:
    return part_main(argv, "layer", run)


if __name__ == "__main__":
    sys.exit(main())
