"""One TT-layer training step in the stack users train with: eager float32, torch.compile,
bf16 autocast, against the dense model (eager and compiled).

A 2-layer MLP (768 -> 3072 -> 768, GELU) at batch 256 is converted with ``comera.convert_``
(public API only); the dense model is the same MLP unconverted. Each variant runs one SGD step
(forward, loss, backward, update); variants are timed round-robin, so load drift hits all alike,
and the report gives the median with the spread (min, max) of the repeats, the first call (for
torch.compile: the compile time, with fresh inductor and tncomp caches unless --warm-caches)
and the machine (torch, CPU, threads, commit).

    python -m benchmarks.speed.bench_stack                 # the 768/3072 MLP, inductor
    python -m benchmarks.speed.bench_stack --transformer   # plus the paper-size transformer step
    python -m benchmarks.speed.bench_stack --smoke --out /tmp/s   # 1 repeat, small MLP, aot_eager

Writes benchmarks/results/stack_cpu.{json,md} (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
from collections.abc import Callable

import torch
from torch import nn

import comera
from benchmarks.lib.cli import add_out, check_at_least_one
from benchmarks.lib.measure import (
    interleaved_times,
    markdown_table,
    publish,
    ratio_spread,
    spread,
    spread_text,
    timed,
)
from comera.experiments.results import machine


def mlp(d_model: int, d_ff: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))


def make_step(model: nn.Module, batch: tuple, autocast: bool = False) -> Callable[[], float]:
    """One SGD training step of ``model`` on ``batch`` (the loss is a float32 mean square)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(*batch)
        loss = out.float().pow(2).mean()
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return step


def variants(dense: nn.Module, tt: nn.Module, batch: tuple, backend: str) -> dict:
    tt_compiled = copy.deepcopy(tt)
    dense_compiled = copy.deepcopy(dense)
    return {
        "dense eager": make_step(dense, batch),
        "dense compiled": make_step(torch.compile(dense_compiled, backend=backend), batch),
        "tt eager fp32": make_step(tt, batch),
        "tt compiled": make_step(torch.compile(tt_compiled, backend=backend), batch),
        "tt bf16 autocast": make_step(copy.deepcopy(tt), batch, autocast=True),
        # bf16 on a CPU without native bf16 GEMMs is emulated: the dense row tells the CPU apart
        "dense bf16 autocast": make_step(copy.deepcopy(dense), batch, autocast=True),
    }


def time_case(steps: dict[str, Callable[[], float]], repeats: int, warmup: int) -> dict:
    """First-call seconds (planning, compiling), then ``repeats`` interleaved timed steps after
    ``warmup`` more (:func:`~benchmarks.lib.measure.interleaved_times`)."""
    first = {name: timed(step).seconds for name, step in steps.items()}
    times = interleaved_times(steps, repeats, warmup)
    base = times["tt eager fp32"]
    stats = {name: spread(ts) for name, ts in times.items()}
    return {name: {"first_call_s": first[name], "median_s": stats[name]["median"],
                   "min_s": stats[name]["min"], "max_s": stats[name]["max"],
                   "repeats": stats[name]["repeats"],
                   "speed_vs_tt_eager": ratio_spread(base, ts)}
            for name, ts in times.items()}


def mlp_case(d_model: int, d_ff: int, batch: int, rank: int, backend: str, repeats: int,
             warmup: int) -> dict:
    torch.manual_seed(0)
    dense = mlp(d_model, d_ff)
    tt = copy.deepcopy(dense)
    report = comera.convert_(tt, ranks=rank)
    x = torch.randn(batch, d_model)
    result = time_case(variants(dense, tt, (x,), backend), repeats, warmup)
    return {"case": f"MLP {d_model}x{d_ff}/{d_ff}x{d_model} batch {batch} rank {rank}",
            "compression": report.before / report.after, "variants": result}


def transformer_case(backend: str, repeats: int, warmup: int, batch: int = 8,
                     seq: int = 128) -> dict:
    from comera.models.transformer import PairClassifier, TransformerConfig

    torch.manual_seed(0)
    tt = PairClassifier(TransformerConfig(tt_embedding=False, dropout=0.0))
    dense = PairClassifier(TransformerConfig(linear_format="dense", dropout=0.0))
    ids = torch.randint(1, tt.cfg.vocab_size, (batch, seq))
    result = time_case(variants(dense, tt, (ids,), backend), repeats, warmup)
    return {"case": f"paper-size transformer (TT layers, dense embedding) batch {batch} x {seq}",
            "variants": result}


def render(payload: dict) -> str:
    lines = ["# One training step in the user's stack (CPU)", ""]
    m = payload["machine"]
    lines.append(f"torch {m['torch']}, {m['cpu']}, {m['threads']} threads, commit "
                 f"{m['commit']}, {m['date']}; torch.compile backend `{payload['backend']}`; "
                 f"{'fresh' if payload['fresh_caches'] else 'warm'} compile and plan caches "
                 "(first call = planning + compiling).")
    for case in payload["cases"]:
        lines += ["", f"## {case['case']}", ""]
        rows = []
        for name, v in case["variants"].items():
            rows.append([name, f"{v['median_s'] * 1e3:.1f}",
                         f"{v['min_s'] * 1e3:.1f}-{v['max_s'] * 1e3:.1f}",
                         spread_text(v["speed_vs_tt_eager"]), f"{v['first_call_s']:.2f}"])
        lines.append(markdown_table(["variant", "median ms", "spread ms", "speed vs TT eager",
                                     "first call s"], rows))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", "--quick", dest="quick", action="store_true",
                        help="1 repeat of a small MLP with the aot_eager backend (seconds)")
    parser.add_argument("--transformer", action="store_true",
                        help="also time the paper-size transformer step (minutes)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--backend", default=None, help="torch.compile backend")
    parser.add_argument("--threads", type=int, default=None)
    add_out(parser, None, "default stack_cpu, or stack_cpu_quick with --quick")
    parser.add_argument("--warm-caches", action="store_true",
                        help="keep inductor's and tncomp's caches (default: fresh ones, so the "
                             "first call is the compile a new user waits for)")
    args = parser.parse_args(argv)
    check_at_least_one(parser, args, "repeats", "threads")
    if not args.warm_caches:
        fresh = tempfile.mkdtemp(prefix="bench_stack_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(fresh, "inductor")
        os.environ["TNCOMP_CACHE_DIR"] = os.path.join(fresh, "tncomp")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    backend = args.backend or ("aot_eager" if args.quick else "inductor")
    # Start the compiler once (worker pool, imports) so no variant's first call pays for it.
    torch.compile(lambda t: t.sin() + 1, backend=backend)(torch.zeros(3))
    repeats = args.repeats or (1 if args.quick else 15)
    warmup = 1 if args.quick else 3
    if args.quick:
        cases = [mlp_case(64, 256, 32, 4, backend, repeats, warmup)]
    else:
        cases = [mlp_case(768, 3072, 256, 30, backend, repeats, warmup)]
        if args.transformer:
            cases.append(transformer_case(backend, repeats, warmup))
    payload = {"benchmark": "stack", "backend": backend, "machine": machine(),
               "fresh_caches": not args.warm_caches, "cases": cases}
    name = args.out or ("stack_cpu_quick" if args.quick else "stack_cpu")
    publish(name, payload, render(payload))
    return payload


if __name__ == "__main__":
    main()
