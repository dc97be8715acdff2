r"""How far each core of each format moves per optimizer step, next to the dense weight
(issue 30): the diagnostic behind the balanced parametrization.

    python -m benchmarks.studies.relative_updates --d-model 256 --target 8 --steps 100 --every 10

The causal LM of the frontier (``benchmarks/studies/lm_frontier.py``): every block linear layer
in one format at the largest uniform rank within ``--target``, built with each parametrization
(``plain``: one Gaussian scale for every core, as before issue 30; ``balanced``:
:mod:`comera.formats.scaling`), and the dense model, trained ``--steps`` steps on the engine with
plain AdamW at ``--lr`` (warm-up, then constant). :class:`comera.RelativeUpdateLog` measures every
``--every``-th step: per layer, ``||dW|| / ||W||`` of the product weight and ``||dG_k|| /
||G_k||`` of every core. Reported per format and parametrization: each core's relative update
(the median over the block layers and the measured steps), the spread between a format's
fastest and slowest core (``imbalance``), and the weight's relative update next to dense's.

Writes ``benchmarks/results/relative_updates/relative_updates.{json,md,png}`` (each row's
measurements per step, its ``curves``, to the git-ignored ``curves/relative_updates.json``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

import comera
from benchmarks.lib.measure import RESULTS
from benchmarks.studies.harness.methods import Study
from benchmarks.studies.harness.results import write_summary
from comera.experiments.engine import EngineConfig
from comera.experiments.lm_task import LMTask, LMTaskConfig
from comera.experiments.results import machine
from comera.formats.registry import DENSE, format_names, get_format
from comera.formats.scaling import PARAMETRIZATIONS
from tncomp.files import atomic_write_text

FORMATS = tuple(f for f in format_names() if get_format(f).from_modes)


def measure(task, study: Study, fmt: str, parametrization: str | None, args) -> dict | None:
    """Train one model ``--steps`` steps and collect its update sizes (None when not even rank
    1 of ``fmt`` fits the target)."""
    rank = None if fmt == DENSE else study.uniform_rank(fmt, args.target)
    if rank == 0:
        return None
    torch.manual_seed(args.seed)
    model = (task.build(DENSE) if fmt == DENSE
             else task.build(fmt, rank, parametrization=parametrization))
    blocks = dict(task.block_linears(model))
    with comera.RelativeUpdateLog(model, every=args.every) as log:
        name = f"{fmt}-{parametrization or 'dense'}"
        study.run(name, fmt, study.config_for(args.seed, args.lr, args.steps),
                  lambda: model)
    per_core: list[list[float]] = []
    weight = []
    for _, sizes in log.steps:
        for layer, update in sizes.layers.items():
            if layer in blocks:
                weight.append(update.weight)
                per_core.append(list(update.cores))
    cores = [statistics.median(c[k] for c in per_core) for k in range(len(per_core[0]))]
    return {"format": fmt, "parametrization": parametrization, "rank": rank,
            "cores": cores, "imbalance": max(cores) / min(cores),
            "weight": statistics.median(weight),
            "curves": [[s, {n: {"weight": u.weight, "cores": list(u.cores)}
                           for n, u in sizes.layers.items() if n in blocks}]
                      for s, sizes in log.steps]}


def table(rows: list[dict]) -> str:
    dense = next(r for r in rows if r["format"] == DENSE)["weight"]
    out = ["| format | parametrization | rank | relative update per core (median) | "
           "imbalance | weight's relative update | vs dense's |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        cores = " ".join(f"{c:.1e}" for c in r["cores"])
        out.append(f"| {r['format']} | {r['parametrization'] or '-'} | {r['rank'] or '-'} | "
                   f"{cores} | {r['imbalance']:.2f} | {r['weight']:.2e} | "
                   f"{r['weight'] / dense:.2f}x |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    dense = next(r for r in rows if r["format"] == DENSE)["weight"]
    formats = [f for f in dict.fromkeys(r["format"] for r in rows) if f != DENSE]
    cols = 4
    fig, axes = plt.subplots((len(formats) + cols - 1) // cols, cols, figsize=(13, 6.2),
                             squeeze=False, sharey=True)
    for ax, fmt in zip(axes.flat, formats, strict=False):
        width = 0.8 / len(PARAMETRIZATIONS)
        for i, par in enumerate(("plain", "balanced")):
            row = next((r for r in rows if r["format"] == fmt and r["parametrization"] == par),
                       None)
            if row is None:
                continue
            xs = [k + (i - 0.5) * width for k in range(len(row["cores"]))]
            ax.bar(xs, row["cores"], width, label=f"{par} (core)",
                   color=("tab:gray", "tab:blue")[i])
            ax.axhline(row["weight"], color=("tab:gray", "tab:blue")[i], ls=":", lw=1.2,
                       label=f"{par}: W")
        ax.axhline(dense, color="black", ls="--", lw=1.2, label="dense W")
        ax.set_yscale("log")
        ax.set_title(get_format(fmt).title, fontsize=10)
        ax.set_xlabel("core")
    for ax in list(axes.flat)[len(formats):]:
        ax.axis("off")
    axes.flat[0].set_ylabel("||dG|| / ||G|| per step (median)")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--target", type=float, default=8.0)
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="a tiny model and corpus for a test")
    p.add_argument("--root", type=Path, default=None)
    p.add_argument("--out", type=Path, default=RESULTS / "relative_updates")
    p.add_argument("--work", type=Path, default=Path("/tmp/relative_updates_work"))
    args = p.parse_args(argv)
    if args.steps < 1 or args.every < 1 or args.target <= 1 or args.lr <= 0:
        p.error("--steps and --every at least 1, --target above 1, --lr above 0")
    torch.set_num_threads(args.threads)
    if args.smoke:
        config = LMTaskConfig(seq_len=16, vocab_size=64, d_model=16, n_heads=2, d_ff=32,
                              n_layers=1, eval_limit=8)
    else:
        config = LMTaskConfig(d_model=args.d_model, d_ff=4 * args.d_model)
    task = LMTask(config, root=args.root)
    engine = EngineConfig(batch_size=16, lr=args.lr, warmup=args.warmup,
                          eval_every=args.steps, max_grad_norm=1.0, threads=args.threads,
                          optimizer="adamw", schedule="constant")
    study = Study(task, engine, args.work, steps=args.steps)
    rows = [measure(task, study, DENSE, None, args)]
    for fmt in args.formats:
        for par in ("plain", "balanced"):
            row = measure(task, study, fmt, par, args)
            if row is None:
                print(f"{fmt}: rank 1 is above the {args.target:g}x budget; skipped", flush=True)
                break
            rows.append(row)
            print(f"{fmt} {par}: imbalance {rows[-1]['imbalance']:.2f}, W "
                  f"{rows[-1]['weight']:.2e}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.studies.relative_updates " + " ".join(
        sys.argv[1:] if argv is None else argv)
    payload = {"command": command, "machine": machine(), "settings": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rows": rows}
    write_summary(args.out / "relative_updates.json", payload)  # per step: curves/
    title = (f"Relative update per step, LM d_model {config.d_model}, {args.target:g}x, AdamW "
             f"lr {args.lr:g}, {args.steps} steps")
    plotted = plot(rows, args.out / "relative_updates.png", title)
    text = (f"# {title}\n\nEach core's ||dG_k|| / ||G_k|| per optimizer step (median over the "
            "block layers and the measured steps); imbalance = fastest / slowest core; the "
            "weight's ||dW|| / ||W|| next to the dense model's.\n\n" + table(rows)
            + ("\n\n![relative updates](relative_updates.png)" if plotted else "")
            + f"\n\nMachine: {payload['machine']['cpu']}, torch {payload['machine']['torch']}; "
            f"command:\n\n    {command}\n")
    atomic_write_text(args.out / "relative_updates.md", text)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
