"""One training step (forward, backward, AdamW step) of the language-model frontier's models,
side by side in one process: the clock the frontier's wall-clock curves are drawn with.

    python -m benchmarks.studies.lm_clock                  # d_model 256, 4x / 8x / 16x
    python -m benchmarks.studies.lm_clock --widths 112 96 80   # and dense at those widths
    python -m benchmarks.studies.lm_clock --smoke --out /tmp/lm_clock
    python -m benchmarks.studies.lm_clock --targets 8 --only btt --methods btt+rms btt+zero

The causal LM of ``benchmarks/studies/lm_frontier.py`` (d_model ``--d-model``, FFN 4x, two
blocks, 64 tokens, batch 16): dense, and per target the narrower dense model of the same size
and every format (and CoLA) at its largest uniform rank (the frontier's methods, built by its
harness);
with ``--widths``, dense at each of those d_model widths too (``dense@96``: the frontier's
``narrow`` method with ``--widths``, its FFN at the task's ratio); with ``--methods``, per target
the frontier's format methods with options too (``btt+rms 8x``: BTT with its cores' RMS bound
run before each forward, as the frontier trains it; :mod:`benchmarks.studies.harness.methods`),
so an option's cost per step is measured beside the plain format's; ``--only`` times just those
formats (dense always).
Each model takes its steps round-robin with the others (:func:`benchmarks.lib.measure.
interleaved_times`), on the frontier's batches; the table gives the median step and its ratio
to dense with the spread of the per-round ratios, the step's peak memory
(:func:`comera.experiments.step_cost.measure_step`: resident plus the most allocated during a
step) and its FLOPs as torch's ``FlopCounterMode`` counts them (matrix products of the forward
and backward: what the frontier's "loss against FLOPs" axis multiplies by the steps). A
training run's own clock is only as quiet as the machine it ran on; this one is measured in one
process on a quiet machine, and the frontier's "loss against wall-clock" curves are the steps
times these medians.

Writes ``benchmarks/results/lm_clock_cpu.{json,md}`` (a study's companion, so it lives with the
studies: it builds the frontier's models through their harness).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

import torch

from benchmarks.lib.measure import (
    interleaved_times,
    markdown_table,
    publish,
    ratio_spread,
    spread_text,
    start_run,
)
from benchmarks.studies.harness.methods import (
    Study,
    build,
    check_method,
    narrow_sizes,
    split_method,
    width_sizes,
)
from benchmarks.studies.harness.options import split_options
from comera.errors import ConfigError
from comera.experiments.engine import EngineConfig
from comera.experiments.lm_task import LMTask, LMTaskConfig
from comera.experiments.results import machine
from comera.experiments.step_cost import measure_step
from comera.experiments.task import IndexStream
from comera.formats.registry import DENSE

#: The formats timed at each target, and the layer kinds that are not formats (CoLA).
FORMATS = ("tt", "ttm", "btt", "lowrank", "cola")


def models(task: LMTask, targets, widths=(), methods=(),
           formats=FORMATS) -> dict[str, torch.nn.Module]:
    """Dense, dense at each of ``widths`` (``dense@<width>``), and per target the narrower
    dense model, every one of ``formats`` at its uniform rank and every format method of
    ``methods`` (``btt+rms``: built and hooked as the frontier trains it) at its own."""
    study = Study(task, EngineConfig(), Path("/tmp/unused"), steps=1, widths=tuple(widths))
    torch.manual_seed(0)
    out = {"dense": task.build(DENSE)}
    for width in widths:
        out[f"dense@{width}"] = task.build(DENSE, **study.width_sizes(width))
    for target in targets:
        sizes = narrow_sizes(task, study.whole_budget(target), whole=True)
        out[f"narrow {target:g}x"] = task.build(DENSE, **sizes)
        for fmt in formats:
            rank = study.uniform_rank(fmt, target)
            if rank >= 1:
                out[f"{fmt} {target:g}x"] = build(task, fmt, rank)
        for method in methods:
            base = split_method(method)[0]
            kind, options = split_options(base)
            rank = study.uniform_rank(base, target)
            if rank >= 1:
                model = build(task, kind, rank, **study.option_sizes(base))
                out[f"{base} {target:g}x"] = study.with_options(model, options)
    return out


def stepper(task: LMTask, model: torch.nn.Module, batch_size: int):
    """(the optimizer, one AdamW step of ``model`` on the next of the frontier's batches)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    stream = IndexStream(task.train_size(), batch_size, 0)
    state = {"step": 0}

    def step() -> None:
        loss = task.loss(model, task.step_batch(stream, state["step"]))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        state["step"] += 1

    return optimizer, step


def step_flops(step) -> int:
    """The FLOPs of one call of ``step`` as torch's flop counter counts them (matrix products,
    forward and backward)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--targets", type=float, nargs="+", default=[4, 8, 16])
    p.add_argument("--widths", type=int, nargs="+", default=[],
                   help="also dense at these d_model widths (multiples of the heads)")
    p.add_argument("--methods", nargs="+", default=[],
                   help="also these format methods with options (btt+rms, btt+zero+rms2)")
    p.add_argument("--only", nargs="+", default=None, choices=FORMATS,
                   help="time only these formats (and dense, narrow, --methods)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's own, the cores)")
    p.add_argument("--smoke", action="store_true", help="a tiny model, few repeats")
    p.add_argument("--root", type=Path, default=None)
    p.add_argument("--out", default="lm_clock_cpu",
                   help="results name under benchmarks/results/ or a path stem")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.batch < 1 or any(t <= 1 for t in args.targets):
        p.error("--repeats and --batch at least 1, --targets above 1")
    if args.smoke:
        config = LMTaskConfig(seq_len=16, vocab_size=64, d_model=16, n_heads=2, d_ff=64,
                              n_layers=1, eval_limit=8)
        args.repeats, args.targets = 3, [2.0]
    else:
        config = LMTaskConfig(d_model=args.d_model, d_ff=4 * args.d_model)
    for method in args.methods:  # checked before any data is read
        try:
            check_method(method)
        except ConfigError as exc:
            p.error(f"--methods: {exc}")
        if "+" not in split_method(method)[0]:
            p.error(f"--methods {method}: give a format with options (btt+rms); the plain "
                    "formats are timed anyway")
    for width in args.widths:  # the frontier's rule, checked before any data is read
        try:
            width_sizes(config, width)
        except ConfigError as exc:
            p.error(f"--widths: {exc}")
    start_run(p, args.threads)
    task = LMTask(config, root=args.root)
    built = models(task, args.targets, args.widths, args.methods,
                   tuple(args.only) if args.only else FORMATS)
    steppers = {name: stepper(task, m, args.batch) for name, m in built.items()}
    times = interleaved_times({name: step for name, (_, step) in steppers.items()},
                              args.repeats, warmup=5)
    results = {}
    for name, ts in times.items():
        spread = ratio_spread(ts, times["dense"])
        optimizer, step = steppers[name]
        cost = measure_step(built[name], optimizer, step, steps=1)
        results[name] = {"ms": 1000 * statistics.median(ts), "vs_dense": spread,
                         "params": sum(p.numel() for p in built[name].parameters()),
                         "peak_mib": cost.peak_bytes / 2**20, "gflops": step_flops(step) / 1e9}
    payload = {"machine": machine(), "mode": "smoke" if args.smoke else "full",
               "d_model": config.d_model, "batch": args.batch, "seq_len": config.seq_len,
               "repeats": args.repeats, "results": results,
               "command": "python -m benchmarks.studies.lm_clock " + shlex.join(
                   sys.argv[1:] if argv is None else argv)}
    rows = [[name, r["params"], f"{r['ms']:.1f}", spread_text(r["vs_dense"]),
             f"{r['peak_mib']:.1f}", f"{r['gflops']:.3f}"] for name, r in results.items()]
    m = payload["machine"]
    markdown = (f"# One training step of the LM frontier's models (d_model {config.d_model}, "
                f"batch {args.batch} x {config.seq_len} tokens)\n\n"
                + markdown_table(["model", "parameters", "median step (ms)",
                                  "time / dense (spread)", "step peak (MiB)",
                                  "GFLOPs per step"], rows)
                + f"\n\nForward, backward and an AdamW step; interleaved, {args.repeats} "
                f"rounds after 5 warm-up steps. Step peak: resident (parameters, optimizer "
                f"state, batch) plus the most allocated during one step (gradients "
                f"included). FLOPs: torch's flop counter over one step. {m['cpu']}, torch "
                f"{m['torch']}, {m['threads']} thread(s). Command: `{payload['command']}`.\n")
    return publish(args.out, payload, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
