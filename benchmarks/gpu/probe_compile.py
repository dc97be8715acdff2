"""Which ``torch.compile`` set-up of the whole CoMERA step survives on CUDA: the paper transformer
at batch 1 in bf16, each stage compiled and run 6 steps beside the uncaptured body
(``CapturedStep(mode="eager")``), losses and parameters compared (``benchmarks/gpu/probes.sh``;
results in benchmarks/results/h100/compile_probe.md).

    python -m benchmarks.gpu.probe_compile SETUP {cuda,cpu} [comera_late,comera_early]

SETUP: ``base`` (as shipped: reduce-overhead), ``mark`` (``cudagraph_mark_step_begin`` before
each step), ``eagerinit`` (one eager step first, then as ``mark``), ``notrees`` (inductor's CUDA
graphs without trees), ``default`` (no CUDA graphs). Run each in its own process: a failed
capture can leave the process's CUDA state broken. On the CPU: toy sizes, ``aot_eager``."""

from __future__ import annotations

import json
import sys
import traceback

import torch

from benchmarks.gpu import step
from benchmarks.gpu.common import summary, time_ms
from benchmarks.lib.measure import timed
from benchmarks.speed.bench_transformer import BenchConfig, make_batch, smoke_config
from comera.models.transformer import TransformerConfig
from comera.training.capture import CapturedStep

SETUPS = ("base", "mark", "eagerinit", "notrees", "default")
STEPS = 6


def run(stage: str, mode: str, device: str, cfg, compile_mode: str | None = "reduce-overhead",
        mark: bool = False, eager_first: bool = False):
    """(losses, flat parameters, seconds of the first steps, timing, the CapturedStep)."""
    model, _, trainer, _ = step.build(stage, cfg, BenchConfig(), device)
    batch = tuple(t.to(device) for t in make_batch(cfg, 1, cfg.max_len).tensors())
    if eager_first:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = step.loss_fn(model, *batch)
        trainer.step(loss)
    backend = "aot_eager" if device == "cpu" and mode == "compile" else "inductor"
    captured = CapturedStep(trainer, step.loss_fn, mode=mode, autocast=torch.bfloat16,
                            compile_mode=compile_mode, backend=backend)

    def call():
        if mark:
            torch.compiler.cudagraph_mark_step_begin()
        return captured(*batch)

    first = timed(lambda: [float(call()) for _ in range(STEPS)])  # the capture included
    losses, first_s = first.value, first.seconds
    timing = summary(time_ms(call, device, 2 if device == "cpu" else 8, 1))
    params = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    return losses, params, first_s, timing, captured


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or argv[0] not in SETUPS or argv[1] not in ("cuda", "cpu"):
        print(f"usage: probe_compile {{{','.join(SETUPS)}}} {{cuda,cpu}} [stages]", file=sys.stderr)
        return 2
    setup, device = argv[0], argv[1]
    stages = argv[2].split(",") if len(argv) == 3 else ["comera_late", "comera_early"]
    cfg = smoke_config() if device == "cpu" else TransformerConfig()
    if setup == "notrees":
        import torch._inductor.config as inductor_config
        inductor_config.triton.cudagraph_trees = False
    out = {"setup": setup, "torch": torch.__version__, "stages": [],
           "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    for stage in stages:
        record: dict = {"stage": stage}
        try:
            ref_losses, ref_params, _, ref_timing, _ = run(
                stage, "eager", device, cfg, eager_first=setup == "eagerinit")
            losses, params, first_s, timing, captured = run(
                stage, "compile", device, cfg, mark=setup in ("mark", "eagerinit"),
                eager_first=setup == "eagerinit",
                compile_mode=None if setup == "default" else "reduce-overhead")
            record.update(
                status="ok", eager_ms=ref_timing["ms"], ms=timing["ms"], first_steps_s=first_s,
                captures=captured.captures, losses=losses, ref_losses=ref_losses,
                max_loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
                param_rel_diff=float((params - ref_params).norm() / ref_params.norm()))
        except Exception as exc:  # a probe: every failure is the finding, recorded
            record.update(status="failed", error=f"{type(exc).__name__}: {str(exc)[:600]}",
                          where=traceback.format_exc()[-1500:])
        print(setup, json.dumps(record)[:400], flush=True)
        out["stages"].append(record)
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
