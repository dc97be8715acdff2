"""Part 4 of ``make gpu``: one training step of the reference Criteo-Kaggle DLRM at its full
table sizes (33.8 M rows, dimension 16): dense tables vs TT tables vs TT tables with TT-Rec's
hot-row cache, built exactly as benchmarks/speed/bench_dlrm.py builds them (same configs, trainers,
batch of synthetic Zipf ids), then moved to the GPU.

Time: CUDA events, median of the repeats after warm-up; memory:
``torch.cuda.max_memory_allocated`` over one step, everything included (tables, optimizer state,
gradients, activations)."""

from __future__ import annotations

import sys

from benchmarks.gpu.common import (
    Deadline,
    PartWriter,
    allocated_bytes,
    guarded,
    part_main,
    peak_bytes,
    summary,
    time_ms,
)
from benchmarks.speed.bench_dlrm import VARIANTS, Batch, BenchConfig, build_variant, make_batch

BATCHES = (2048, 16384)


def run(writer: PartWriter, deadline: Deadline, args) -> None:
    device = args.device
    repeats = args.repeats or (1 if args.smoke else 10)
    warmup = 1 if args.smoke else 3
    for size in ((64,) if args.smoke else BATCHES):
        bench = (BenchConfig(batch=size, max_rows=2000, cache_rows=16) if args.smoke
                 else BenchConfig(batch=size))
        cpu_batch = make_batch(bench.model_config("dense"), bench.batch, bench.seed)
        batch = Batch(*(t.to(device) for t in cpu_batch.tensors()))
        for name in VARIANTS:

            def case(name=name, bench=bench, batch=batch) -> dict:
                before = allocated_bytes(device)  # left by earlier cases (and the batch)
                variant = build_variant(name, bench)
                variant.model.to(device)  # same Parameter objects: the optimizer follows
                result = summary(time_ms(lambda: variant.step(batch), device, repeats, warmup))
                peak = peak_bytes(lambda: variant.step(batch), device, since=before)
                result["peak_mib"] = None if peak is None else peak / 2**20
                info = {k: v for k, v in variant.info.items()
                        if k in ("params", "effective_size", "table_params",
                                 "table_compression", "model_compression", "cache_rows")}
                return {"variant": name, "batch": bench.batch, **info, **result}

            guarded(writer, deadline, f"{name} B={size}", 3 if args.smoke else 15, case)


def main(argv: list[str] | None = None) -> int:
    return part_main(argv, "dlrm", run)


if __name__ == "__main__":
    sys.exit(main())
