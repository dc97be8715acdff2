"""The paper's models, plain and readable: a six-encoder transformer for sentence pairs."""

from comera.models.transformer import PairClassifier, TransformerConfig

__all__ = ["PairClassifier", "TransformerConfig"]
