"""`make gpu` (``python -m benchmarks.gpu``): every GPU claim of the project in one command.

Parts, each in a process of its own under a hard time budget (``__main__``):

1. ``pytest -m gpu``: the CUDA tests (graphs, bf16/fp16, inductor, torch.func, float64);
2. :mod:`benchmarks.gpu.layer`: one TT layer at 768x3072 and at a LLaMA-1B shape;
3. :mod:`benchmarks.gpu.step`: the paper's six-encoder training step (dense, GaLore, CoMERA);
4. :mod:`benchmarks.gpu.dlrm`: the DLRM Kaggle step (dense, TT, TT + hot rows).

Shared pieces: :mod:`benchmarks.gpu.common` (CUDA-event timing, peak memory, budgets, the
incremental part writer), :mod:`benchmarks.gpu.report` (results files and the summary table),
:mod:`benchmarks.gpu.galore` (GaLoreAdamW without bitsandbytes). ``wheels.sh`` prepares the
wheels a machine without a package index needs. See docs/gpu.md.
"""
