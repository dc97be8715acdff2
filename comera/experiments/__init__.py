"""Experiments of the paper, runnable from the `comera train` command."""
