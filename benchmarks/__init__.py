"""The benchmarks: scripts run as modules from the repository root
(``python -m benchmarks.speed.bench_tt_linear``), their shared code in :mod:`benchmarks.lib`,
and the committed results in ``benchmarks/results/``."""
