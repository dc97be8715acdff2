"""Part 3 of ``make gpu``: one training step of the paper's six-encoder transformer (MNLI
configuration, sequence 128) at batch 1 and 32.

Variants: ``dense`` (AdamW), ``galore`` (GaLoreAdamW, the GaLore recipe; skipped with a note when
galore-torch is absent), ``comera_early`` (TT layers at the initial ranks, the rank regulariser in
the objective) and ``comera_late`` (gates pruned to the paper's late-stage compression, truncated,
late-stage steps): built as benchmarks/speed/bench_transformer.py builds them. Execution modes:

- ``eager``: the trainer's step (``CoMERATrainer.step`` / forward, backward, AdamW);
- ``graphs``: CoMERA through :class:`comera.training.capture.CapturedStep` (``mode="graphs"``:
  ``make_graphed_callables`` over forward, objective and backward); dense through
  ``make_graphed_callables`` over forward and loss; the optimizer step after it, eager;
- ``compile``: ``torch.compile(mode="reduce-overhead")`` over the whole step (CoMERA:
  ``CapturedStep(mode="compile")``).

GaLore runs eager only (its projection refresh is an SVD on the host's schedule). Precisions:
fp32, and bf16 autocast (parameters and optimizer state fp32). Time: CUDA events, median of the
repeats after warm-up; memory: ``torch.cuda.max_memory_allocated`` over one step, everything
included (parameters, optimizer state, activations), less what earlier cases left; under CUDA
graphs that misses the pool's transient buffers, so ``peak_reserved_mib`` (reserved memory, the
graph's pool included) is recorded beside it, and the memory targets compare eager steps.
Cases run in priority order (:func:`cases`) and stop at the part's budget.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor, nn
from torch.nn import functional as F

import comera
from benchmarks.gpu.common import (
    Deadline,
    PartWriter,
    allocated_bytes,
    guarded,
    part_main,
    peak_bytes,
    reserved_bytes,
    summary,
    time_ms,
)
from benchmarks.gpu.galore import ensure_galore
from benchmarks.lib.model_baselines import GaLoreConfig, default_galore_rank, make_galore_optimizer
from benchmarks.speed.bench_transformer import (
    BenchConfig,
    late_stage_cap,
    make_batch,
    prune_gates_to_cap_,
    smoke_config,
)
from comera.models.transformer import PairClassifier, TransformerConfig
from comera.training.capture import CapturedStep

VARIANTS = ("dense", "galore", "comera_early", "comera_late")
MODES = ("eager", "graphs", "compile")
DTYPES = {"bf16": torch.bfloat16, "fp32": None}
BATCHES = (1, 32)
ESTIMATE_S = {"eager": 8.0, "graphs": 15.0, "compile": 90.0}  # a case's build, warm-up, repeats


def loss_fn(model: nn.Module, ids: Tensor, segments: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(model(ids, segments), labels)


def build(variant: str, cfg: TransformerConfig, bench: BenchConfig, device: str):
    """(model, optimizer, trainer or None, info) of one variant, seeded, on ``device``."""
    torch.manual_seed(bench.seed)
    if variant in ("dense", "galore"):
        model = PairClassifier(replace(cfg, linear_format="dense")).to(device)
        if variant == "dense":
            opt = torch.optim.AdamW(model.parameters(), lr=bench.lr, weight_decay=0.0)
        else:
            opt = make_galore_optimizer(model, GaLoreConfig(
                rank=bench.galore_rank or default_galore_rank(cfg.d_model), lr=bench.lr))
        return model, opt, None, {"params": sum(p.numel() for p in model.parameters())}
    model = PairClassifier(cfg).to(device)  # the layers in cfg's format (TT by default)
    opt = comera.make_optimizer(model)
    trainer = comera.CoMERATrainer(model, opt, lam=bench.lam)
    info: dict = {}
    if variant == "comera_late":
        cap = late_stage_cap(model, bench.late_compression)
        prune_gates_to_cap_(model, cap)
        trainer.start_late_stage(comera.LateStage(target_size=float(comera.model_size(model))))
        info["max_rank"] = cap
    info.update({"params": sum(p.numel() for p in model.parameters()),
                 "effective_size": comera.model_size(model),
                 "model_compression": comera.compression_ratio(model)})
    return model, opt, trainer, info


class _Loss(nn.Module):
    """forward = the loss of a batch (what make_graphed_callables graphs for the dense model)."""

    def __init__(self, model: nn.Module, autocast: torch.dtype | None):
        super().__init__()
        self.model, self.autocast = model, autocast

    def forward(self, ids: Tensor, segments: Tensor, labels: Tensor) -> Tensor:
        with torch.autocast(ids.device.type, dtype=self.autocast,
                            enabled=self.autocast is not None, cache_enabled=False):
            return loss_fn(self.model, ids, segments, labels)


def step_fn(variant: str, mode: str, model, opt, trainer, batch: tuple[Tensor, ...],
            autocast: torch.dtype | None) -> tuple[Callable[[], object], CapturedStep | None]:
    """One training step of ``variant`` in execution ``mode``, as a no-argument callable (and
    the CoMERA capture behind it, whose ``captures`` the results report)."""
    device = batch[0].device.type
    if trainer is not None:
        if mode == "eager":
            def eager() -> None:
                with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
                    loss = loss_fn(model, *batch)
                trainer.step(loss)
            return eager, None
        captured = CapturedStep(trainer, loss_fn, mode=mode, autocast=autocast)
        return (lambda: captured(*batch)), captured
    objective = _Loss(model, autocast)

    def plain(loss_of: Callable[..., Tensor]) -> Callable[[], None]:
        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss_of(*batch).backward()
            opt.step()
        return step

    if mode == "eager":
        return plain(objective), None
    if mode == "graphs":
        return plain(torch.cuda.make_graphed_callables(objective, batch)), None
    return torch.compile(plain(objective), mode="reduce-overhead", dynamic=False), None


def cases(smoke: bool, device: str) -> list[tuple[str, str, str, int]]:
    """(variant, mode, dtype, batch) in priority order: every eager case first (bf16, the
    targets' precision, then fp32), then CUDA graphs, and the compile cases (the slowest to set
    up) last, CoMERA late first within each. Eager goes first because a capture that fails can
    leave the process's CUDA state broken (a generator stuck in capture mode) for every case
    after it."""
    batches = (1, 2) if smoke else BATCHES
    graphs = ("graphs",) if device.startswith("cuda") else ()
    order = [("bf16", "eager"), ("fp32", "eager"), *[("bf16", m) for m in graphs],
             *[("fp32", m) for m in graphs], ("bf16", "compile"), ("fp32", "compile")]
    out = []
    for dtype, mode in order:
        variants = VARIANTS if mode == "eager" else ("comera_late", "dense", "comera_early")
        for b in (batches if mode == "eager" else sorted(batches)):
            out += [(v, mode, dtype, b) for v in variants]
    return out


def run(writer: PartWriter, deadline: Deadline, args) -> None:
    device = args.device
    cfg = smoke_config() if args.smoke else TransformerConfig()
    bench = BenchConfig()
    repeats = args.repeats or (1 if args.smoke else 10)
    warmup = 1 if args.smoke else 3
    galore_note = ensure_galore()
    if galore_note:
        writer.note("galore", f"skipped: {galore_note}")
    for variant, mode, dname, b in cases(args.smoke, device):
        name = f"{variant} {mode} {dname} B={b}"
        if variant == "galore" and galore_note:
            writer.skip(name, galore_note)
            continue

        def case(variant=variant, mode=mode, dname=dname, b=b) -> dict:
            before = allocated_bytes(device)  # left by earlier cases: not this case's
            reserved_before = reserved_bytes(device)
            model, opt, trainer, info = build(variant, cfg, bench, device)
            batch = tuple(t.to(device) for t in make_batch(cfg, b, cfg.max_len).tensors())
            fn, captured = step_fn(variant, mode, model, opt, trainer, batch, DTYPES[dname])
            result = summary(time_ms(fn, device, repeats, warmup))
            peak = peak_bytes(fn, device, since=before)
            result["peak_mib"] = None if peak is None else peak / 2**20
            result["left_before_mib"] = None if before is None else before / 2**20
            reserved = reserved_bytes(device, peak=True)
            result["peak_reserved_mib"] = (None if reserved is None or reserved_before is None
                                           else (reserved - reserved_before) / 2**20)
            if captured is not None:
                result["captures"] = captured.captures
            return {"variant": variant, "mode": mode, "dtype": dname, "batch": b,
                    "seq_len": cfg.max_len, **info, **result}

        guarded(writer, deadline, name, 3 if args.smoke else ESTIMATE_S[mode], case)


def main(argv: list[str] | None = None) -> int:
    return part_main(argv, "step", run)


if __name__ == "__main__":
    sys.exit(main())
