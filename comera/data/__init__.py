"""Real data available offline: (docstring, code) pairs from the CPython standard library."""

from comera.data.stdlib_pairs import PairDataset, Tokenizer, load_stdlib_pairs

__all__ = ["PairDataset", "Tokenizer", "load_stdlib_pairs"]
