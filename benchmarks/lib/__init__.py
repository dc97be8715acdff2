"""Shared code of the benchmark scripts: timing and memory measurement and result files
(:mod:`.harness`), the layer baselines (:mod:`.baselines`) and the model baselines
(:mod:`.model_baselines`)."""
