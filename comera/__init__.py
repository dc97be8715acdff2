"""comera: CoMERA rank-adaptive tensor-train training on tncomp plans.

Layers (``TTLinear``, ``TTMLinear``, ``TTEmbedding``) carry diagonal rank gates; the objective
(``rank_regularizer``, ``LateStage``) drives ranks down; ``truncate_`` removes pruned ranks
physically; ``convert_`` turns an existing torch model into a TT model.
``scaled_dot_product_attention`` and ``BoolMaskDropout`` are torch's attention and dropout,
bit for bit, keeping less for the CPU backward.
"""

from comera.attention import TTMultiheadAttention
from comera.cached_embedding import CachedTTEmbedding
from comera.checkpoint import (
    CheckpointRecord,
    checkpoint_payload,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from comera.convert import ConversionReport, ConvertConfig, convert_
from comera.dropout import BoolMaskDropout
from comera.embedding import TTEmbedding
from comera.errors import (
    CheckpointError,
    ComeraError,
    ConfigError,
    ConversionError,
    DataFormatError,
    FactorizationError,
    LookupIndexError,
    NonFiniteError,
    NonFiniteGradientError,
    NonFiniteLossError,
    TrainingStopped,
)
from comera.factorize import factorize, factorize_pair, suggest_padded_size
from comera.layers import GatedTrain, TTLinear, TTMLinear
from comera.objective import LateStage, rank_regularizer, soft_size
from comera.pretrained import from_pretrained, save_pretrained
from comera.sdpa import scaled_dot_product_attention
from comera.siblings import Siblings
from comera.size import compression_ratio, dense_size, model_size, tt_modules
from comera.surgery import layer_spec
from comera.train import (
    CoMERATrainer,
    DenseTrainer,
    OptimizerConfig,
    StepStats,
    make_optimizer,
    param_groups,
)
from comera.truncate import TruncationReport, truncate_

__all__ = [
    "BoolMaskDropout",
    "CachedTTEmbedding",
    "CheckpointError",
    "CheckpointRecord",
    "CoMERATrainer",
    "ComeraError",
    "ConfigError",
    "ConversionError",
    "ConversionReport",
    "ConvertConfig",
    "DataFormatError",
    "DenseTrainer",
    "FactorizationError",
    "GatedTrain",
    "LateStage",
    "LookupIndexError",
    "NonFiniteError",
    "NonFiniteGradientError",
    "NonFiniteLossError",
    "OptimizerConfig",
    "Siblings",
    "StepStats",
    "TTEmbedding",
    "TTLinear",
    "TTMLinear",
    "TTMultiheadAttention",
    "TrainingStopped",
    "TruncationReport",
    "checkpoint_payload",
    "compression_ratio",
    "convert_",
    "dense_size",
    "factorize",
    "factorize_pair",
    "from_pretrained",
    "layer_spec",
    "load_checkpoint",
    "make_optimizer",
    "model_size",
    "param_groups",
    "rank_regularizer",
    "read_checkpoint",
    "save_checkpoint",
    "save_pretrained",
    "scaled_dot_product_attention",
    "soft_size",
    "suggest_padded_size",
    "truncate_",
    "tt_modules",
]
