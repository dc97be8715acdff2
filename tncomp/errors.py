"""One exception hierarchy for tncomp.

Every class also subclasses the matching builtin, so ``except ValueError`` in user code keeps
working. Messages say what was expected, what was received, and how to fix it.
"""

from __future__ import annotations

__all__ = ["CacheError", "CalibrationError", "CudaGraphError", "DtypeError", "ExecutionError",
           "IRError", "MemoryLimitError", "OperandError", "OptionError", "PlanError",
           "PlotDependencyError", "PlotError", "SizeError", "SpecError", "TncompError"]


class TncompError(Exception):
    """Base class of every error raised by tncomp."""


class IRError(TncompError, ValueError):
    """A malformed network: bad index, size conflict, dangling output index, ..."""


class SizeError(TncompError, ValueError):
    """Sizes that cannot be bound: a symbol out of its bounds, a shape that does not match."""


class DtypeError(SizeError, TypeError):
    """Operands whose dtypes (or devices) cannot be contracted together, such as float32 cores
    with a bfloat16 input outside ``torch.autocast``. Also a :class:`SizeError` (what earlier
    versions raised) and a ``TypeError``."""


class PlanError(TncompError, RuntimeError):
    """No valid contraction plan could be built for a network."""


class MemoryLimitError(PlanError, MemoryError):
    """No plan of a network fits the memory limit (``compile(..., memory_limit=...)``,
    ``$TNCOMP_MEMORY_LIMIT``, by default half of the device's memory): refused before anything
    is allocated. Also a :class:`PlanError` and a ``MemoryError``."""


class ExecutionError(TncompError, RuntimeError):
    """A plan failed while executing; the message names the step."""


class CacheError(TncompError, RuntimeError):
    """The on-disk cache could not be read or written."""


class CalibrationError(TncompError, RuntimeError):
    """A device calibration whose measurements are not plausible (a thin GEMM far slower than
    the square GEMM's rate predicts, a square GEMM rate that changed during the run): refused
    and not saved, as measurements taken while other work held the cores."""


class CudaGraphError(TncompError, RuntimeError):
    """A CUDA-graph capture was refused or replayed with an incompatible input."""


class OperandError(TncompError, TypeError):
    """An operand that is not a torch tensor (a list, None, a numpy array, ...)."""


class SpecError(TncompError, ValueError):
    """A layer SPEC on the command line that cannot be read."""


class OptionError(TncompError, ValueError):
    """An option whose value cannot be used: a keyword of ``compile`` / ``contract`` or a
    command-line flag."""


class PlotError(TncompError, ValueError):
    """A picture that cannot be made as asked: a bad output path or option."""


class PlotDependencyError(TncompError, ImportError):
    """Matplotlib, needed for pictures only, is not installed."""
