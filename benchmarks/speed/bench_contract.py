"""Small-call overhead of ``tncomp.contract`` next to ``torch.einsum`` (issue 24).

On tiny operands a call is all overhead: parsing, cache lookups, checks, the autograd
Function. Both run side by side in one process on one thread, interleaved (round k times a
batch of calls of each, in turn), after warm-up, so the plan is cached and drift hits both
alike; the table gives the median microseconds per call and the ratio with its spread over
the rounds. Writes benchmarks/results/contract_overhead_cpu.{json,md}.

    python -m benchmarks.speed.bench_contract                    # the full run
    python -m benchmarks.speed.bench_contract --smoke --out /tmp/contract   # quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch

import tncomp
from benchmarks.lib.cli import add_out, check_at_least_one, run_header
from benchmarks.lib.measure import (
    interleaved_times,
    markdown_table,
    num_threads,
    publish,
    ratio_spread,
    spread_text,
)

TARGET = 1.5  # issue 24: contract within 1.5x of torch.einsum on a tiny call

# (name, equation, shapes): tiny operands, so the time is the call's overhead
CASES = (
    ("matmul", "ij,jk->ik", ((4, 5), (5, 3))),
    ("batched", "bij,bjk->bik", ((2, 4, 5), (2, 5, 3))),
    ("three operands", "ij,jk,kl->il", ((4, 5), (5, 3), (3, 2))),
    ("implicit output", "ij,jk", ((4, 5), (5, 3))),
    ("diagonal", "iij,jk->ik", ((4, 4, 5), (5, 3))),
)
MODES = ("no grad", "forward with grad", "forward + backward")


def _calls(eq: str, shapes, mode: str) -> dict[str, Callable[[], object]]:
    gen = torch.Generator().manual_seed(0)
    grad = mode != "no grad"
    ts = [torch.randn(s, generator=gen, requires_grad=grad) for s in shapes]
    if mode == "forward + backward":
        def run(fn):
            def call():
                fn(eq, *ts).sum().backward()
            return call
    else:
        def run(fn):
            def call():
                fn(eq, *ts)
            return call
    return {"contract": run(tncomp.contract), "einsum": run(torch.einsum)}


def measure(eq: str, shapes, mode: str, rounds: int, inner: int) -> dict:
    """Median seconds per call of contract and einsum, each round a batch of ``inner`` calls
    of one then the other."""
    # warm-up: the plan is built and cached, caches are hot
    times = interleaved_times(_calls(eq, shapes, mode), rounds, max(inner, 50), inner=inner)
    spread = ratio_spread(times["contract"], times["einsum"])
    return {"contract_us": statistics.median(times["contract"]) * 1e6,
            "einsum_us": statistics.median(times["einsum"]) * 1e6, "spread": spread}


def render_markdown(payload: dict) -> str:
    m = payload["machine"]
    rows = [[r["case"], f"`{r['eq']}`", r["mode"], f"{r['contract_us']:.1f}",
             f"{r['einsum_us']:.1f}", spread_text(r["spread"]),
             "yes" if r["spread"]["ratio"] <= TARGET else "**no**"] for r in payload["results"]]
    return "\n".join([
        "# Small-call overhead of tncomp.contract vs torch.einsum (CPU)",
        "",
        f"torch {m['torch']}, {m['cpu']} ({m['cores']} cores), {m['threads']} thread(s), commit "
        f"{m['commit']}, {m['date']}; {payload['mode']} mode: {payload['rounds']} interleaved "
        f"rounds of {payload['inner']} calls each, medians per call, after warm-up (plans "
        "cached). Default options; float32 operands of a few elements, so the times are the "
        "calls' overhead.",
        "",
        markdown_table(["case", "eq", "mode", "contract us", "einsum us",
                        "contract / einsum (spread over rounds)", f"<= {TARGET:g}x"], rows),
        "",
        "A repeat call of `contract` with the default options is one dict lookup keyed by "
        "(equation, shapes, `$TNCOMP_CACHE_DIR`) and the compiled network's own lookup by "
        "binding (shapes, dtype, device, gradients); with gradients it runs the planned "
        "forward inside one autograd Function.",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="quick: few rounds, one case")
    parser.add_argument("--threads", type=int, default=1)
    add_out(parser, "contract_overhead_cpu")
    args = parser.parse_args(argv)
    check_at_least_one(parser, args, "threads")
    rounds, inner = (5, 20) if args.smoke else (41, 200)
    cases = CASES[:1] if args.smoke else CASES
    results = []
    with num_threads(args.threads):
        for name, eq, shapes in cases:
            for mode in MODES:
                r = measure(eq, shapes, mode, rounds, inner)
                results.append({"case": name, "eq": eq, "shapes": [list(s) for s in shapes],
                                "mode": mode, **r})
                print(f"{name} {mode}: contract {r['contract_us']:.1f} us, einsum "
                      f"{r['einsum_us']:.1f} us, {spread_text(r['spread'])}", flush=True)
        payload = {**run_header(args), "rounds": rounds, "inner": inner, "target": TARGET,
                   "results": results}
    return publish(args.out, payload, render_markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
