"""Speed and memory benchmarks: one script per measurement, run as
``python -m benchmarks.speed.bench_*`` from the repository root; results under
``benchmarks/results/``."""
