r"""The compression frontier of the masked language model (issue 23).

    python -m benchmarks.studies.mlm_frontier --seeds 0 1 2 --targets 8 \
        --methods dense fixed lowrank comera spectrum --tag t8

The quick MLM of ``comera train mlm --quick`` (d_model 128, 2 blocks, 64 tokens, batch 32, lr
1e-3, warm-up 50, 300 + 150 steps) with a dense token table and head, so every method
compresses the same layers: the encoder blocks' linear layers (biases included). Methods,
protocol and outputs: :mod:`benchmarks.studies.harness.frontier`. The metric the issue's target
names is the test loss (masked-token cross-entropy on fixed masks); the validation loss is
reported beside (and chooses each method's learning rate from ``--lrs``).
"""

from __future__ import annotations

from benchmarks.lib.measure import RESULTS
from benchmarks.studies.harness.frontier import Spec, task_config
from benchmarks.studies.harness.frontier import main as frontier_main
from comera.experiments.mlm_task import MLMTask, MLMTaskConfig

SPEC = Spec(name="mlm", title="Masked LM on CPython stdlib sources", out=RESULTS / "mlm_frontier",
            make_task=lambda args: MLMTask(task_config(MLMTaskConfig, args), root=args.root),
            defaults={"batch": 32, "lr": 1e-3, "targets": [8]}, split="test")


def main(argv=None) -> int:
    return frontier_main(SPEC, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
