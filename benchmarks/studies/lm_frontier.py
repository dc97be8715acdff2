r"""The compression frontier of the causal language model (issues 23, 30).

    python -m benchmarks.studies.lm_frontier --seeds 0 1 2 --targets 8 --tag t8
    python -m benchmarks.studies.lm_frontier --seeds 0 --targets 4 16 32 \
        --methods tt lowrank comera --tag rest-s0
    python -m benchmarks.studies.lm_frontier --seeds 0 --targets 8 --lrs 1e-3 3e-3 1e-2 \
        --schedule cosine --methods dense narrow tt ttm btt lowrank comera --tag grid-s0
    # equal wall-clock: each model the steps its measured step time buys in dense's 800
    python -m benchmarks.studies.lm_clock --targets 4 8 16 --threads 1
    python -m benchmarks.studies.lm_frontier --d-model 256 --early 1 --late 799 --warmup 100 \
        --optimizer adamw --equal-time --clock benchmarks/results/lm_clock_cpu.json \
        --out benchmarks/results/lm_equal_time_d256 --seeds 0 --targets 8 \
        --methods dense narrow tt:balanced ttm:balanced btt:balanced lowrank:balanced \
        --lrs 3e-4 1e-3 3e-3 --tag grid-s0
    # CoMERA on BTT (from its largest rank that compresses) against BTT at a fixed rank
    python -m benchmarks.studies.lm_frontier --d-model 128 --seeds 0 1 2 --targets 8 \
        --lrs 3e-3 --methods btt:balanced comera@btt:balanced --tag comera-btt
    # the dense frontier below the narrowest measured width, at equal wall-clock (each width
    # timed side by side with dense in its own clock file)
    python -m benchmarks.studies.lm_clock --targets 16 --widths 112 96 80 64 --threads 1 \
        --out lm_clock_widths_cpu
    python -m benchmarks.studies.lm_frontier --d-model 256 --early 1 --late 799 --warmup 100 \
        --optimizer adamw --equal-time --clock benchmarks/results/lm_clock_widths_cpu.json \
        --out benchmarks/results/lm_equal_time_d256 --seeds 0 --lrs 1e-3 3e-3 \
        --methods narrow --widths 112 96 80 64 --tag widths-s0

The quick causal LM of ``comera train lm --quick`` (d_model 128, 2 blocks, 64 tokens, batch 16,
lr 2e-3, warm-up 50, 300 + 150 steps); its block linear layers have no biases, so compression
is of weight parameters. Methods, protocol and outputs:
:mod:`benchmarks.studies.harness.frontier`.
The metric is the validation loss (perplexity); the test loss is reported beside. With
``--equal-time`` (:mod:`benchmarks.studies.harness.equal_time`) every model trains for dense's
wall-clock instead of dense's steps, and ``equal_time.md`` / ``equal_time.png`` give the loss at
each budget.
"""

from __future__ import annotations

from benchmarks.lib.measure import RESULTS
from benchmarks.studies.harness.frontier import Spec, task_config
from benchmarks.studies.harness.frontier import main as frontier_main
from comera.experiments.lm_task import LMTask, LMTaskConfig

SPEC = Spec(name="lm", title="Causal LM on CPython stdlib sources", out=RESULTS / "lm_frontier",
            make_task=lambda args: LMTask(task_config(LMTaskConfig, args), root=args.root),
            defaults={"batch": 16, "lr": 2e-3, "targets": [8, 4, 16, 32]}, split="val")


def main(argv=None) -> int:
    return frontier_main(SPEC, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
