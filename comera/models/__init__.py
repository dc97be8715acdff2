"""The paper's models, plain and readable: the six-encoder transformer (pair classification),
DLRM with TT embedding tables, and a BERT-style masked-language model."""

from comera.models.dlrm import DLRM, DLRMConfig
from comera.models.mlm import MaskedLM
from comera.models.transformer import PairClassifier, TransformerConfig

__all__ = ["DLRM", "DLRMConfig", "MaskedLM", "PairClassifier", "TransformerConfig"]
