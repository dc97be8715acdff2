"""One training step of a small GPT whose block linear layers are in each format, against dense.

The model is :class:`comera.models.causal_lm.CausalLM` (pre-LayerNorm, 2 blocks, byte
vocabulary, FFN 4x, 4 heads) at batch 32 x 64 tokens. Its block linear layers are converted
right after initialisation with ``comera.convert_(model, ConvertConfig(format=F,
target_compression=8))`` for F in ttm, btt, tt and lowrank; beside them run the dense model and
a narrower dense model whose block layers hold about as many parameters as the compressed ones
(the largest d_model, a multiple of the heads, with its FFN at 4x, whose block layers fit the
dense block layers / 8). One step is forward, a cross-entropy loss, backward and
``torch.optim.AdamW.step``; the models take their steps round-robin
(:func:`benchmarks.lib.measure.interleaved_times`), at one thread by default, and each ratio to
dense carries the spread of the per-round ratios. The peak memory of one step above what the
model, gradients and optimizer hold is the profiler's (:func:`benchmarks.lib.measure.
measure_step_memory`, tncomp's buffer pools off while measuring).

Per layer (block 0's q, ffn_in and ffn_out: the three shapes), each format's plan at the step's
rows (batch x tokens) is set beside its floor (:meth:`tncomp.compiler.plan.Plan.floor_time`
under the device model the layer plans with) and the measured time of each of its steps
(:func:`tncomp.runtime.profile.measure_plan`); the JSON holds the eight heaviest steps of
each plan (and the sum over all), the table the three heaviest.

    python -m benchmarks.speed.bench_gpt_step                  # d_model 128 and 512
    python -m benchmarks.speed.bench_gpt_step --d-model 256 --repeats 5
    python -m benchmarks.speed.bench_gpt_step --smoke --out /tmp/gpt_step   # tiny, one repeat
    python -m benchmarks.speed.bench_gpt_step --d-model 512 --formats btt ttm --memory fast min

``--memory`` runs each format once per tncomp memory mode (``ConvertConfig(memory=...)``: what
the backward keeps and what it recomputes); a row of a mode other than ``fast`` is named
``format/mode``.

Writes benchmarks/results/gpt_step_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from torch import nn

import comera
from benchmarks.lib.cli import add_gpt_options, add_out, check_gpt_options, run_header
from benchmarks.lib.measure import (
    interleaved_times,
    markdown_table,
    measure_step_memory,
    publish,
    ratio_spread,
    spread_text,
)
from comera.models.causal_lm import CausalLM, CausalLMConfig
from tncomp.runtime.profile import measure_plan

FORMATS = ("ttm", "btt", "tt", "lowrank")
COMPRESSION = 8.0
VOCAB = 256  # bytes
HEADS = 4
LAYERS = ("attn.q", "ffn_in", "ffn_out")  # the three shapes of a block's linear layers
TOP_STEPS = 3  # steps per plan in the markdown table ...
JSON_STEPS = 8  # ... and in the JSON (the heaviest by measured time; a results file stays small)


def config(d_model: int, tokens: int) -> CausalLMConfig:
    return CausalLMConfig(vocab_size=VOCAB, d_model=d_model, n_heads=HEADS, d_ff=4 * d_model,
                          n_layers=2, max_len=tokens)


def block_params(d_model: int, d_ff: int) -> int:
    """Weights of one block's six linear layers (no biases: the model's block layers have
    none)."""
    return 4 * d_model * d_model + 2 * d_model * d_ff


def narrow_width(d_model: int, compression: float) -> int:
    """The largest d_model (a multiple of the heads, FFN 4x) whose block layers hold at most
    the dense model's block layers over ``compression``."""
    budget = block_params(d_model, 4 * d_model) / compression
    widths = [d for d in range(HEADS, d_model + 1, HEADS) if block_params(d, 4 * d) <= budget]
    if not widths:
        raise SystemExit(f"no narrower model of d_model {d_model} fits 1/{compression:g} of "
                         "its block layers; choose a larger --d-model")
    return widths[-1]


MEMORY_MODES = ("fast", "balanced", "min")  # tncomp's named memory modes


def kind_name(fmt: str, memory: str) -> str:
    """A row's name: the format alone at ``fast`` (tncomp's default), else ``format/mode``."""
    return fmt if memory == "fast" else f"{fmt}/{memory}"


def build(kind: str, d_model: int, tokens: int) -> nn.Module:
    """Dense, narrow (dense at :func:`narrow_width`) or a format converted at the target
    (``format/mode`` at that memory mode)."""
    torch.manual_seed(0)
    if kind == "narrow":
        return CausalLM(config(narrow_width(d_model, COMPRESSION), tokens))
    model = CausalLM(config(d_model, tokens))
    if kind != "dense":
        fmt, _, memory = kind.partition("/")
        comera.convert_(model, comera.ConvertConfig(format=fmt, target_compression=COMPRESSION,
                                                    memory=memory or "fast"))
    return model


def block_weights(model: CausalLM) -> int:
    return sum(p.numel() for _, m in model.block_linears() for p in m.parameters())


def trainer(model: nn.Module, ids: torch.Tensor):
    """``(optimizer, step)``: one AdamW step on next-token cross-entropy of ``ids``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        logits = model(ids[:, :-1])  # (b, s-1, V)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return opt, step


def layer_profile(model: nn.Module, rows: int, repeats: int) -> list[dict]:
    """Block 0's q, ffn_in and ffn_out: each plan's floor, its measured total and steps."""
    out = []
    for name in LAYERS:
        layer = model.blocks[0].get_submodule(name)
        if not isinstance(layer, comera.GatedLayer):
            continue
        compiled = layer.compiled()
        net = compiled.network
        sizes = {**{i: s for i, s in net.sizes if isinstance(s, int)}, "b": rows}
        plan = compiled.plan_for(sizes, (True,) * len(net.operands))
        model_ = compiled.model(torch.device("cpu"))
        shapes = [tuple(sizes[i] for i in t.indices) for t in net.operands]
        measured = measure_plan(plan, shapes, repeats=repeats)
        steps = []
        for which, ops, times in (("fwd", plan.forward, measured.forward),
                                  ("bwd", plan.backward, measured.backward)):
            for k, (op, t) in enumerate(zip(ops, times, strict=True)):
                steps.append({"pass": which, "step": k, "op": op.describe(),
                              "mflop": op.flops / 1e6, "mb": op.nbytes / 1e6,
                              "floor_ms": model_.step_floor(op) * 1e3, "ms": t * 1e3})
        out.append({"layer": name, "shape": [layer.in_features, layer.out_features],
                    "ranks": list(layer.bond_sizes),
                    "modes": [list(layer.in_modes), list(layer.out_modes)],
                    "flops": plan.forward_flops + plan.backward_flops,
                    "dense_flops": 3 * 2 * rows * layer.in_features * layer.out_features,
                    "floor_ms": plan.floor_time(model_) * 1e3, "ms": measured.total * 1e3,
                    "n_steps": len(steps), "steps_ms": sum(s["ms"] for s in steps),
                    "steps": heaviest(steps, JSON_STEPS)})
    return out


def heaviest(steps: list[dict], n: int) -> list[dict]:
    """The ``n`` steps of the most measured time, in plan order."""
    keep = sorted(range(len(steps)), key=lambda k: -steps[k]["ms"])[:n]
    return [steps[k] for k in sorted(keep)]


def run_width(d_model: int, batch: int, tokens: int, repeats: int, warmup: int,
              step_repeats: int, formats: tuple[str, ...],
              memory: tuple[str, ...] = ("fast",)) -> dict:
    """Every model at ``d_model`` (each format at each memory mode): step times, ratios to
    dense, peak memory, layer plans."""
    ids = torch.randint(0, VOCAB, (batch, tokens + 1), generator=torch.Generator().manual_seed(0))
    kinds = ("dense", *(kind_name(f, m) for f in formats for m in memory), "narrow")
    models = {k: build(k, d_model, tokens + 1) for k in kinds}
    trainers = {k: trainer(m, ids) for k, m in models.items()}
    times = interleaved_times({k: step for k, (_, step) in trainers.items()}, repeats, warmup)
    dense_blocks = block_weights(models["dense"])
    rows = []
    for kind, model in models.items():
        opt, step = trainers[kind]
        memory = measure_step_memory(model, opt, step, [ids])
        rows.append({
            "model": kind, "d_model": model.cfg.d_model,
            "block_params": block_weights(model),
            "block_compression": dense_blocks / block_weights(model),
            "params": sum(p.numel() for p in model.parameters()),
            "ms": statistics.median(times[kind]) * 1e3,
            "vs_dense": ratio_spread(times[kind], times["dense"]),
            "peak_extra_mib": memory["peak_extra_bytes"] / 2**20,
            "resident_mib": memory["resident_bytes"]["total"] / 2**20,
            "layers": layer_profile(model, batch * tokens, step_repeats),
        })
    return {"d_model": d_model, "batch": batch, "tokens": tokens, "repeats": repeats,
            "rows": rows}


def markdown(payload: dict) -> str:
    m = payload["machine"]
    lines = [
        "# One training step of a small GPT, each format at ~8x vs dense (CPU)",
        "",
        f"{m['cpu']}, torch {m['torch']}, {m['threads']} thread(s), commit {m['commit']}, "
        f"{m['date']}. {payload['note_machine']}",
        "",
        "Model: `comera.models.causal_lm.CausalLM`, 2 pre-norm blocks, byte vocabulary, FFN 4x, "
        "4 heads; block linear layers converted with `convert_(model, ConvertConfig(format=F, "
        "target_compression=8))` (a row `F/mode`: with `memory=mode`, tncomp's choice of what "
        "the backward recomputes); narrow: dense at the d_model whose block layers fit 1/8. One "
        "step = forward, cross-entropy, backward, AdamW. Medians of interleaved rounds; the "
        "ratio to dense with the IQR and range of the per-round ratios. Peak: the profiled peak "
        "allocated during one step above the resident model, gradients and optimizer state.",
        "",
        f"Command: `{payload['command']}`",
    ]
    for width in payload["widths"]:
        lines += ["", f"## d_model {width['d_model']}, batch {width['batch']} x "
                      f"{width['tokens']} tokens, {width['repeats']} rounds", ""]
        table = [[r["model"], r["d_model"], f"{r['block_compression']:.1f}x",
                  f"{r['ms']:.1f}", spread_text(r["vs_dense"]), f"{r['peak_extra_mib']:.0f}",
                  f"{r['resident_mib']:.1f}"] for r in width["rows"]]
        lines.append(markdown_table(
            ["model", "d_model", "block layers vs dense", "step ms", "vs dense",
             "step peak MiB", "resident MiB"], table))
        prof = []
        for r in width["rows"]:
            for layer in r["layers"]:
                heavy = sorted(layer["steps"], key=lambda s: -s["ms"])[:TOP_STEPS]
                prof.append([r["model"], f"{layer['layer']} {layer['shape'][0]}x"
                             f"{layer['shape'][1]}", layer["ranks"],
                             f"{layer['flops'] / layer['dense_flops']:.2f}",
                             f"{layer['floor_ms']:.2f}", f"{layer['ms']:.2f}",
                             "; ".join(f"{s['pass']} {s['op'][:40]} {s['ms']:.2f} "
                                       f"(floor {s['floor_ms']:.2f})" for s in heavy)])
        if prof:
            lines += ["", "Per layer (block 0), fwd+bwd of the plan alone at the step's rows: "
                      "FLOPs over dense's, the plan's floor, measured, and its heaviest steps "
                      "(ms).", ""]
            lines.append(markdown_table(["model", "layer", "ranks", "FLOPs vs dense",
                                         "floor ms", "measured ms", "heaviest steps"], prof))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--memory", nargs="+", default=["fast"], choices=MEMORY_MODES,
                        help="tncomp memory modes to run each format at (default fast)")
    add_gpt_options(parser, widths="widths to run (default 128 512; smoke: 128)",
                    repeats="interleaved rounds",
                    smoke="d_model 128, batch 4 x 16 tokens, one round: checks the script",
                    note="The machine was shared with other jobs (loaded): compare ratios "
                    "within one run only.")
    add_out(parser, "gpt_step_cpu")
    args = parser.parse_args(argv)
    check_gpt_options(parser, args, HEADS)
    torch.set_num_threads(args.threads)
    # smoke: the smallest width at which every format reaches 8x (convert_ refuses a target it
    # cannot reach)
    widths = args.d_model or ([128] if args.smoke else [128, 512])
    batch, tokens = (4, 16) if args.smoke else (32, 64)
    results = []
    for d_model in widths:
        repeats = args.repeats or (1 if args.smoke else 11 if d_model <= 256 else 7)
        width = run_width(d_model, batch, tokens, repeats, 1 if args.smoke else 2,
                          1 if args.smoke else 5, tuple(args.formats),
                          tuple(dict.fromkeys(args.memory)))
        results.append(width)
        for r in width["rows"]:
            print(f"d_model {d_model} {r['model']:>8}: {r['ms']:.1f} ms "
                  f"({spread_text(r['vs_dense'])} dense), peak {r['peak_extra_mib']:.0f} MiB",
                  file=sys.stderr)
    payload = {**run_header(args), "device": "CPU", "note_machine": args.note,
               "command": "python -m benchmarks.speed.bench_gpt_step "
                          + " ".join(argv if argv is not None else sys.argv[1:]),
               "compression": COMPRESSION, "widths": results}
    return publish(args.out, payload, markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
