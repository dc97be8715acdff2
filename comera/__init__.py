"""comera: CoMERA rank-adaptive tensor-train training on tncomp plans.

Layers (``GatedLinear`` and ``GatedEmbedding`` in any weight format, ``TTLinear``,
``TTMLinear``, ``TTEmbedding``) carry diagonal rank gates; a new format is a
``comera.formats.registry.Format`` subclass given to ``register_format`` there (or one line in
the registry's built-in list); the objective
(``LateStage``; ``comera.ranks.objective.rank_regularizer``) drives ranks down; ``truncate_``
removes pruned ranks physically; ``convert_`` turns an existing torch model into a TT model;
``RankController`` runs the rank-adaptive stages inside any training loop (``CoMERATrainer`` is
one such loop); ``FinetuneRecipe`` and ``finetune`` fine-tune a converted model at the measured
recipe (``hold_gates_`` holds its ranks in a trainer of one's own, e.g. HuggingFace's).
``comera.lean`` holds torch's attention and dropout, bit for bit, keeping less for the CPU
backward.

``__all__`` holds what the documentation calls; a few more names live in their submodules
(``comera.ranks.objective.rank_regularizer`` and ``soft_size``, ``comera.ranks.size.dense_size``,
``comera.ranks.truncate.TruncationReport``, ``comera.formats.factorize.factorize``,
``factorize_pair`` and ``suggest_padded_size``, ``comera.formats.registry.Format`` and
``register_format``, ``comera.training.controller.clear_moments_``, ``comera.training.early.
EarlyStage``, ``comera.training.trainers.param_groups``, ``comera.training.relative_updates.
RelativeUpdates``, ``comera.surgery.convert.ConversionReport``, ``comera.layers.siblings.
Siblings``, ``comera.layers.cached_embedding.CachedTTEmbedding``, ``comera.lean.sdpa.
scaled_dot_product_attention``, ``comera.lean.dropout.BoolMaskDropout``): ``comera.<name>``
still works until 0.3.0, with a DeprecationWarning naming the submodule.
"""

from comera.errors import (
    CaptureError,
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
from comera.layers.attention import TTMultiheadAttention
from comera.layers.embedding import GatedEmbedding, TTEmbedding
from comera.layers.linear import GatedLayer, GatedLinear, TTLinear, TTMLinear
from comera.ranks.objective import LateStage
from comera.ranks.size import compression_ratio, gated_layers, model_size
from comera.ranks.truncate import truncate_
from comera.surgery.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
from comera.surgery.config import ConvertConfig
from comera.surgery.convert import convert_
from comera.surgery.pretrained import from_pretrained, save_pretrained
from comera.training.controller import RankController, late_stage_for
from comera.training.finetune import FinetuneRecipe, finetune, hold_gates_
from comera.training.relative_updates import RelativeUpdateLog, relative_updates
from comera.training.trainers import (
    CoMERATrainer,
    DenseTrainer,
    OptimizerConfig,
    StepStats,
    make_optimizer,
)
from tncomp.extend import renamed

__all__ = [
    "CaptureError",
    "CheckpointError",
    "CoMERATrainer",
    "ComeraError",
    "ConfigError",
    "ConversionError",
    "ConvertConfig",
    "DataFormatError",
    "DenseTrainer",
    "FactorizationError",
    "FinetuneRecipe",
    "GatedEmbedding",
    "GatedLayer",
    "GatedLinear",
    "LateStage",
    "LookupIndexError",
    "NonFiniteError",
    "NonFiniteGradientError",
    "NonFiniteLossError",
    "OptimizerConfig",
    "RankController",
    "RelativeUpdateLog",
    "StepStats",
    "TTEmbedding",
    "TTLinear",
    "TTMLinear",
    "TTMultiheadAttention",
    "TrainingStopped",
    "compression_ratio",
    "convert_",
    "finetune",
    "from_pretrained",
    "gated_layers",
    "hold_gates_",
    "late_stage_for",
    "load_checkpoint",
    "make_optimizer",
    "model_size",
    "read_checkpoint",
    "relative_updates",
    "save_checkpoint",
    "save_pretrained",
    "truncate_",
]

#: Names outside ``__all__``, each warning until 0.3.0: the deprecated aliases, naming their
#: replacement, and the names that left the face in 0.2.0 (no page of the documentation calls
#: them from ``comera``), naming the submodule that keeps them.
__getattr__ = renamed("comera", {
    "GatedTrain": ("comera:GatedLayer", "0.3.0"),
    "tt_modules": ("comera:gated_layers", "0.3.0"),
    "UpdateSizeLog": ("comera:RelativeUpdateLog", "0.3.0"),
    "UpdateSizes": ("comera.training.relative_updates:RelativeUpdates", "0.3.0"),
    "update_sizes": ("comera:relative_updates", "0.3.0"),
    "TruncationReport": ("comera.ranks.truncate:TruncationReport", "0.3.0"),
    "clear_moments_": ("comera.training.controller:clear_moments_", "0.3.0"),
    "factorize_pair": ("comera.formats.factorize:factorize_pair", "0.3.0"),
    "rank_regularizer": ("comera.ranks.objective:rank_regularizer", "0.3.0"),
    "suggest_padded_size": ("comera.formats.factorize:suggest_padded_size", "0.3.0"),
    "RelativeUpdates": ("comera.training.relative_updates:RelativeUpdates", "0.3.0"),
    "dense_size": ("comera.ranks.size:dense_size", "0.3.0"),
    "factorize": ("comera.formats.factorize:factorize", "0.3.0"),
    "param_groups": ("comera.training.trainers:param_groups", "0.3.0"),
    "register_format": ("comera.formats.registry:register_format", "0.3.0"),
    "Format": ("comera.formats.registry:Format", "0.3.0"),
    "soft_size": ("comera.ranks.objective:soft_size", "0.3.0"),
    "CachedTTEmbedding": ("comera.layers.cached_embedding:CachedTTEmbedding", "0.3.0"),
    "EarlyStage": ("comera.training.early:EarlyStage", "0.3.0"),
    "Siblings": ("comera.layers.siblings:Siblings", "0.3.0"),
    "scaled_dot_product_attention": ("comera.lean.sdpa:scaled_dot_product_attention", "0.3.0"),
    "BoolMaskDropout": ("comera.lean.dropout:BoolMaskDropout", "0.3.0"),
    "ConversionReport": ("comera.surgery.convert:ConversionReport", "0.3.0"),
})
