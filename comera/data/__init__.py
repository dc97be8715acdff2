"""Real data available offline: (docstring, code) pairs and source text from the CPython standard
library; Criteo-shaped click data (synthetic, or read from the real TSV files); MNLI from local
files.

Shared parts: :mod:`comera.data.tokenizer` (the word tokenizer and its special tokens),
:mod:`comera.data.cache` (the tensor cache every loader uses) and :mod:`comera.data.progress`.
"""

from comera.data.criteo import (
    CriteoData,
    CriteoSplit,
    SyntheticCriteo,
    load_criteo_tsv,
    load_synthetic_criteo,
    read_criteo_tsv,
)
from comera.data.mnli import MNLI, load_mnli
from comera.data.stdlib_corpus import BertMasking, MLMCorpus, load_stdlib_corpus
from comera.data.stdlib_pairs import PairDataset, load_stdlib_pairs
from comera.data.tokenizer import Tokenizer

__all__ = [
    "MNLI",
    "BertMasking",
    "CriteoData",
    "CriteoSplit",
    "MLMCorpus",
    "PairDataset",
    "SyntheticCriteo",
    "Tokenizer",
    "load_criteo_tsv",
    "load_mnli",
    "load_stdlib_corpus",
    "load_stdlib_pairs",
    "load_synthetic_criteo",
    "read_criteo_tsv",
]
