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

CASES = (  # (label, in_modes, out_modes, max rank, rows)
    ("768x3072 r30", (12, 8, 8), (12, 16, 16), 30, (128, 4096)),
    ("llama1b 2048x8192 r128", (8, 16, 16), (16, 16, 32), 128, (8192,)),
)
SMOKE_CASES = (("64x128 r4", (4, 4, 4), (4, 4, 8), 4, (16,)),)
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
    for name, in_modes, out_modes, rank, rows, dname in plan:

        def case(in_modes=in_modes, out_modes=out_modes, rank=rank, rows=rows,
                 dname=dname) -> dict:
            fns, sizes = methods_for(in_modes, out_modes, rank, rows, DTYPES[dname], device,
                                     quick)
            methods = measure(fns, device, repeats, warmup)
            return {**sizes, "dtype": dname, "methods": methods, **ratios(methods)}

        guarded(writer, deadline, name, 5 if args.smoke else 12, case)
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
