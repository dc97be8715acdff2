"""Where a compressed layer's plan spends its time: every step against what its shape allows.

For block 0's q, ffn_in and ffn_out of the small GPT that ``bench_gpt_step`` times (2 pre-norm
blocks, byte vocabulary, 4 heads, FFN 4x; its block layers converted with ``convert_(model,
format=F, target_compression=8)``), each step of the layer's plan (forward and backward, at
the step's rows) is timed inside the plan (the generated code with a clock read after every
step, as :func:`tncomp.runtime.profile.measure_plan` does) and set beside:

- a GEMM: the same ``(batch; m x k) @ (k x n)`` run as a contiguous ``torch.bmm`` (the rate this
  machine gets for that shape: what the plan's layouts cost on top of it), and its FLOPs at the
  machine's large-GEMM rate (a 2048 x 512 x 512 GEMM measured first: the FLOP floor);
- a permute copy: its bytes at the machine's plain-copy bandwidth (measured first).

Times are the thread's CPU time (:func:`benchmarks.lib.measure.thread_clock`), medians over
the repeats: on a machine shared with other jobs, time spent descheduled is left out
(memory-bandwidth contention is not). Compare within one run only.

    python -m benchmarks.speed.bench_plan_ops                      # btt at d_model 256 and 512
    python -m benchmarks.speed.bench_plan_ops --format ttm --d-model 512
    python -m benchmarks.speed.bench_plan_ops --smoke --out /tmp/plan_ops   # checks the script

Writes benchmarks/results/plan_ops_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import comera
from benchmarks.lib.cli import add_gpt_options, add_out, check_gpt_options, run_header
from benchmarks.lib.measure import markdown_table, publish, thread_clock
from comera.models.causal_lm import CausalLM, CausalLMConfig
from tncomp.compiler.ops import MatMul, Permute
from tncomp.runtime.codegen import generate

clock = thread_clock
TOP_STEPS = 4  # heaviest steps per layer in the markdown table
FORMATS = ("btt", "ttm", "tt", "lowrank")
HEADS = 4
LAYERS = ("attn.q", "ffn_in", "ffn_out")  # the three shapes of a block's linear layers


def build(fmt: str, d_model: int) -> CausalLM:
    """bench_gpt_step's GPT at ``d_model`` with its block layers in ``fmt`` at ~8x."""
    torch.manual_seed(0)
    model = CausalLM(CausalLMConfig(vocab_size=256, d_model=d_model, n_heads=HEADS,
                                    d_ff=4 * d_model, n_layers=2, max_len=65))
    comera.convert_(model, comera.ConvertConfig(format=fmt, target_compression=8.0))
    return model


def median_seconds(fn, repeats: int) -> float:
    """Median thread CPU seconds of ``fn`` over ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def machine_rates(repeats: int, smoke: bool) -> dict[str, float]:
    """The large-GEMM rate (FLOP/s) and the plain-copy bandwidth (bytes read + written per s)."""
    n = 64 if smoke else 512
    a, b = torch.randn(4 * n, n), torch.randn(n, n)
    gemm = 2 * 4 * n * n * n / median_seconds(lambda: torch.mm(a, b), repeats)
    src = torch.randn(1 << (14 if smoke else 22))
    dst = torch.empty_like(src)
    copy = 2 * src.numel() * 4 / median_seconds(lambda: dst.copy_(src), repeats)
    return {"gemm_flops_per_s": gemm, "copy_bytes_per_s": copy}


def step_times(plan, shapes, repeats: int) -> tuple[list[float], list[float], float]:
    """Median thread CPU seconds of each forward and backward step, and of a whole run."""
    ticks: list[tuple[int, int, float]] = []
    code = generate(plan, shapes, mark=lambda which, step: ticks.append((which, step, clock())))
    operands = [torch.randn(s) for s in shapes]
    dy = torch.randn(plan.output_shape)
    forward: list[list[float]] = [[] for _ in plan.forward]
    backward: list[list[float]] = [[] for _ in plan.backward]
    totals = []
    for r in range(repeats + 1):  # the first run warms up
        ticks.clear()
        start = clock()
        code.backward(operands, code.forward(*operands)[1], dy)
        totals.append(clock() - start)
        last: dict[int, float] = {}
        for which, step, when in ticks:
            if r and step >= 0:
                (forward if which == 0 else backward)[step].append(when - last[which])
            last[which] = when
    med = lambda ts: statistics.median(ts) if ts else 0.0  # noqa: E731
    return [med(t) for t in forward], [med(t) for t in backward], med(totals[1:])


def layer_steps(layer: comera.GatedLayer, rows: int, repeats: int, rates: dict) -> dict:
    """One layer's plan at ``rows``: every step's time beside its shape's and floors."""
    compiled = layer.compiled()
    net = compiled.network
    sizes = {**{i: s for i, s in net.sizes if isinstance(s, int)}, "b": rows}
    plan = compiled.plan_for(sizes, (True,) * len(net.operands))
    shapes = [tuple(sizes[i] for i in t.indices) for t in net.operands]
    forward, backward, total = step_times(plan, shapes, repeats)
    steps = []
    for which, ops, times in (("fwd", plan.forward, forward), ("bwd", plan.backward, backward)):
        for k, (op, t) in enumerate(zip(ops, times, strict=True)):
            row = {"pass": which, "step": k, "op": op.describe(), "ms": t * 1e3}
            if isinstance(op, MatMul):
                m, inner = op.lhs.rows_cols
                n, batch = op.rhs.rows_cols[1], op.lhs.batch
                a, b = torch.randn(batch, m, inner), torch.randn(batch, inner, n)
                row |= {"kind": "gemm", "mflop": op.flops / 1e6,
                        "shape_ms": median_seconds(lambda a=a, b=b: torch.bmm(a, b), repeats) * 1e3,
                        "floor_ms": op.flops / rates["gemm_flops_per_s"] * 1e3}
            elif isinstance(op, Permute):
                row |= {"kind": "copy", "mb": op.nbytes / 1e6, "copy_kind": op.kind,
                        "floor_ms": op.nbytes / rates["copy_bytes_per_s"] * 1e3}
            else:
                row["kind"] = "other"
            steps.append(row)
    sums = {kind: {key: sum(s.get(key, 0.0) for s in steps if s["kind"] == kind)
                   for key in ("ms", "shape_ms", "floor_ms")} for kind in ("gemm", "copy")}
    sums["other"] = {"ms": sum(s["ms"] for s in steps if s["kind"] == "other")}
    return {"shape": [layer.in_features, layer.out_features], "ranks": list(layer.bond_sizes),
            "tree": [list(s) for s in plan.tree.steps], "ms": total * 1e3, "sums": sums,
            "steps": steps}


def markdown(payload: dict) -> str:
    m = payload["machine"]
    rates = payload["rates"]
    lines = [
        f"# Where a {payload['format']} layer's plan spends its time (CPU)", "",
        f"{m['cpu']}, torch {m['torch']}, {m['threads']} thread(s), commit {m['commit']}, "
        f"{m['date']}. {payload['note_machine']}", "",
        f"Large-GEMM rate {rates['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s, plain copy "
        f"{rates['copy_bytes_per_s'] / 1e9:.1f} GB/s (read + write). Thread CPU time, medians. "
        "GEMM: measured in the plan / the same shape as a contiguous bmm / FLOPs at the large-"
        "GEMM rate; copy: measured / bytes at the plain-copy bandwidth.", "",
        f"Command: `{payload['command']}`"]
    for width in payload["widths"]:
        lines += ["", f"## d_model {width['d_model']}, {width['rows']} rows", ""]
        table = []
        for name, layer in width["layers"].items():
            g, c = layer["sums"]["gemm"], layer["sums"]["copy"]
            heavy = sorted(layer["steps"], key=lambda s: -s["ms"])[:TOP_STEPS]
            table.append([f"{name} {layer['shape'][0]}x{layer['shape'][1]}", layer["ranks"],
                          f"{layer['ms']:.2f}",
                          f"{g['ms']:.2f} / {g['shape_ms']:.2f} / {g['floor_ms']:.2f}",
                          f"{c['ms']:.2f} / {c['floor_ms']:.2f}",
                          "; ".join(f"{s['pass']} {s['op'][:38]} {s['ms']:.2f}" for s in heavy)])
        lines.append(markdown_table(["layer", "ranks", "fwd+bwd ms", "GEMMs ms (plan / shape "
                                     "/ floor)", "copies ms (plan / floor)", "heaviest steps"],
                                    table))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="btt", choices=FORMATS)
    add_gpt_options(parser, widths="widths (default 256 512; smoke: 128)",
                    repeats="timed runs per step",
                    smoke="d_model 128, 64 rows, one repeat: checks the script",
                    note="The machine was shared with other jobs (loaded): compare within one "
                    "run only.")
    add_out(parser, "plan_ops_cpu")
    args = parser.parse_args(argv)
    check_gpt_options(parser, args, HEADS)
    torch.set_num_threads(args.threads)
    widths = args.d_model or ([128] if args.smoke else [256, 512])
    rows = 64 if args.smoke else 32 * 64
    repeats = args.repeats or (1 if args.smoke else 9)
    rates = machine_rates(repeats, args.smoke)
    results = []
    for d_model in widths:
        model = build(args.format, d_model)
        layers = {name: layer_steps(model.blocks[0].get_submodule(name), rows, repeats, rates)
                  for name in LAYERS
                  if isinstance(model.blocks[0].get_submodule(name), comera.GatedLayer)}
        results.append({"d_model": d_model, "rows": rows, "layers": layers})
        for name, layer in layers.items():
            print(f"d_model {d_model} {name}: {layer['ms']:.2f} ms", file=sys.stderr)
    payload = {**run_header(args), "device": "CPU", "format": args.format,
               "mode": "smoke" if args.smoke else "full", "note_machine": args.note,
               "command": "python -m benchmarks.speed.bench_plan_ops "
                          + " ".join(argv if argv is not None else sys.argv[1:]),
               "rates": rates, "widths": results}
    return publish(args.out, payload, markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
