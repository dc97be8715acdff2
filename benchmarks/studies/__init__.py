"""Training studies: accuracy and loss frontiers over seeds, formats and budgets, run as
``python -m benchmarks.studies.<name>``; results under ``benchmarks/results/<name>/``."""
