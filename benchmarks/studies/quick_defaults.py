r"""The defaults of ``comera train`` against those of before (issues 40 and 43), on the quick LM
and masked LM, over seeds.

    python -m benchmarks.studies.quick_defaults --seeds 0 1 2 --work /tmp/quick_defaults
    python -m benchmarks.studies.quick_defaults --seeds 0 1 2 --work /tmp/quick_defaults \
        --summarise-only                  # the tables again from the runs in --work

Every arm is one ``comera train TASK --quick --seed S --threads 1`` (the task's quick recipe:
its steps, batch, learning rate and target), with:

- ``dense``: ``--variants dense``, the dense model;
- ``before``: ``--format tt --parametrization plain --late-allocation prune``, CoMERA as
  ``comera train`` ran it before 0.2.0 (TT layers, plain cores, the late stage pruning their
  gates);
- ``defaults``: ``--format tt``, 0.2.0's defaults on TT layers (balanced cores;
  ``late_allocation="auto"``, which on TT layers is the spectrum allocation);
- ``ttm``: ``--format ttm``, the defaults on TT-matrix layers (since issue 40 the LM's and the
  masked LM's default format: named, so each arm measures what it says whatever the default).

A run already in ``--work`` (its ``TASK.json`` written) is read, not trained again. Writes
``benchmarks/results/quick_defaults/quick_defaults.{json,md}``: per task and arm the test
metric at the end of the run (the late stage's for CoMERA: perplexity for the LM, loss for the
masked LM), mean ± sd over the seeds, against dense's mean, and the gated layers' compression.
The arms share the quick recipe's learning rate; they are not each at a best rate of a grid
(the d_model 256 frontier in docs/results.md is).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.lib.measure import RESULTS, markdown_table, publish
from comera.experiments.results import machine

#: arm -> the flags it adds to ``comera train TASK --quick --seed S --threads 1``
ARMS = {"dense": ["--variants", "dense"],
        "before": ["--variants", "comera", "--format", "tt", "--parametrization", "plain",
                   "--late-allocation", "prune"],
        "defaults": ["--variants", "comera", "--format", "tt"],
        "ttm": ["--variants", "comera", "--format", "ttm"]}
#: task -> the test metric the tables report
TASKS = {"lm": "perplexity", "mlm": "loss"}


def run_dir(work: Path, arm: str, task: str, seed: int) -> Path:
    return work / f"{arm}-{task}-s{seed}"


def train(work: Path, arm: str, task: str, seed: int) -> None:
    """One ``comera train`` run of ``arm`` in its folder of ``work``, unless it is there."""
    out = run_dir(work, arm, task, seed)
    if (out / f"{task}.json").is_file():
        return
    from comera.cli import main

    code = main(["train", task, "--quick", "--seed", str(seed), "--threads", "1",
                 "--no-progress", "--out", str(out), *ARMS[arm]])
    if code:
        raise SystemExit(f"comera train {task} ({arm}, seed {seed}) exited {code}")


def final_row(path: Path) -> dict:
    """The last row of a ``comera train`` summary: the late stage's for CoMERA, dense's."""
    rows = json.loads(path.read_text())["rows"]
    return rows[-1]


def summarise(work: Path, seeds: list[int]) -> tuple[dict, str]:
    """(payload, markdown) of the runs in ``work``; a missing run is an error naming it."""
    rows, lines = [], []
    for task, metric in TASKS.items():
        table = []
        by_arm = {}
        for arm in ARMS:
            values, compressions = [], []
            for seed in seeds:
                path = run_dir(work, arm, task, seed) / f"{task}.json"
                if not path.is_file():
                    raise SystemExit(f"{path}: no run; train it without --summarise-only")
                row = final_row(path)
                values.append(row["test"][metric])
                compressions.append(row["sizes"].get("tt_compression", 1.0))
            by_arm[arm] = values
            rows.append({"task": task, "arm": arm, "metric": f"test {metric}",
                         "seeds": seeds, "values": values, "compressions": compressions})
        dense = statistics.fmean(by_arm["dense"])
        for row in rows[-len(ARMS):]:
            v = row["values"]
            mean = statistics.fmean(v)
            sd = statistics.stdev(v) if len(v) > 1 else float("nan")
            row |= {"mean": mean, "sd": sd, "vs_dense": mean / dense - 1}
            table.append([row["arm"], " ".join(ARMS[row["arm"]]),
                          " / ".join(f"{x:.3f}" for x in v), f"{mean:.3f} ± {sd:.3f}",
                          f"{row['vs_dense']:+.1%}",
                          " / ".join(f"{c:.1f}x" for c in row["compressions"])])
        lines += [f"## `comera train {task} --quick`: test {metric}", "",
                  markdown_table(["arm", "flags", "per seed", "mean ± sd", "vs dense",
                                  "compression (gated layers)"], table), ""]
    head = ("# The defaults of `comera train`, against those of before\n\n"
            "`comera train TASK --quick --seed S --threads 1` plus each arm's flags, seeds "
            f"{', '.join(map(str, seeds))}; the quick recipe's learning rate for every arm "
            "(no grid). Command: `python -m benchmarks.studies.quick_defaults --seeds "
            f"{' '.join(map(str, seeds))} --work DIR`.\n")
    payload = {"machine": machine(), "seeds": seeds, "arms": ARMS, "rows": rows}
    return payload, head + "\n" + "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--work", type=Path, required=True, help="the runs' folders")
    p.add_argument("--summarise-only", action="store_true",
                   help="read the runs in --work; train nothing")
    p.add_argument("--out", default=str(RESULTS / "quick_defaults" / "quick_defaults"),
                   help="results path stem")
    args = p.parse_args(argv)
    if any(s < 0 for s in args.seeds) or len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds {args.seeds}; give distinct seeds >= 0")
    if args.work.exists() and not args.work.is_dir():
        p.error(f"--work {args.work} is a file; give a folder")
    if not args.summarise_only:
        for seed in args.seeds:
            for task in TASKS:
                for arm in ARMS:
                    train(args.work, arm, task, seed)
    payload, markdown = summarise(args.work, args.seeds)
    return publish(args.out, payload, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
