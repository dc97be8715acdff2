"""The eager bf16 training step of the paper transformer (``benchmarks.gpu.step``'s dense, CoMERA
early and CoMERA late), timed in one process: run it once per code tree, alternating, to compare
two commits on one GPU (``benchmarks/gpu/probes.sh``; results in benchmarks/results/h100/).

    PYTHONPATH=<code tree> python -m benchmarks.gpu.probe_eager_step TAG {cuda,cpu}

Prints a line per case and a final ``RESULT {json}`` line. On the CPU it runs toy sizes (a check
of the script, not a measurement)."""

from __future__ import annotations

import json
import sys

import torch

import comera
from benchmarks.gpu import step
from benchmarks.gpu.common import summary, time_ms
from benchmarks.speed.bench_transformer import BenchConfig, make_batch, smoke_config
from comera.models.transformer import TransformerConfig

VARIANTS = ("dense", "comera_early", "comera_late")


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in ("cuda", "cpu"):
        print("usage: probe_eager_step TAG {cuda,cpu}", file=sys.stderr)
        return 2
    tag, device = argv
    smoke = device == "cpu"
    cfg = smoke_config() if smoke else TransformerConfig()
    bench = BenchConfig()
    out = {"tag": tag, "comera_file": comera.__file__, "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "cases": []}
    for batch_size in ((1, 2) if smoke else (1, 32)):
        for variant in VARIANTS:
            model, opt, trainer, _ = step.build(variant, cfg, bench, device)
            batch = tuple(t.to(device) for t in make_batch(cfg, batch_size, cfg.max_len).tensors())
            fn, _ = step.step_fn(variant, "eager", model, opt, trainer, batch, torch.bfloat16)
            result = summary(time_ms(fn, device, 2 if smoke else 12, 1 if smoke else 3))
            out["cases"].append({"variant": variant, "batch": batch_size, **result})
            print(tag, variant, batch_size, result, flush=True)
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
