"""Criteo click data: a synthetic generator at the Kaggle table sizes, and the real TSV reader.

Three modules: :mod:`~comera.data.criteo.splits` (the split types, table sizes and their cache),
:mod:`~comera.data.criteo.synthetic` (:class:`SyntheticCriteo`, a seeded stand-in for the real
data with Zipf-skewed ids and a planted, learnable label) and :mod:`~comera.data.criteo.tsv`
(the Kaggle TSV files). Both sources give the same tensors and cache them under
:func:`~comera.data.cache.cache_dir`.
"""

from comera.data.criteo.splits import (
    CRITEO_KAGGLE_CARDINALITIES,
    CRITEO_NUM_DENSE,
    SPLITS,
    CriteoData,
    CriteoSplit,
    describe_data,
)
from comera.data.criteo.synthetic import SyntheticCriteo, load_synthetic_criteo, zipf_ranks
from comera.data.criteo.tsv import load_criteo_tsv, read_criteo_tsv
from comera.data.progress import progress_enabled
from comera.errors import DataFormatError

__all__ = [
    "CRITEO_KAGGLE_CARDINALITIES",
    "CRITEO_NUM_DENSE",
    "SPLITS",
    "CriteoData",
    "CriteoSplit",
    "DataFormatError",
    "SyntheticCriteo",
    "describe_data",
    "load_criteo_tsv",
    "load_synthetic_criteo",
    "progress_enabled",
    "read_criteo_tsv",
    "zipf_ranks",
]
