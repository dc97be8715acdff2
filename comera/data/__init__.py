"""Real data available offline: (docstring, code) pairs and source text from the CPython standard
library; Criteo-shaped click data (synthetic, or read from the real TSV files)."""

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
from comera.data.stdlib_pairs import PairDataset, Tokenizer, load_stdlib_pairs

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
