"""One exception hierarchy for comera.

Every class also subclasses the matching builtin, so ``except ValueError`` in user code keeps
working. Messages say what was expected, what was received, and how to fix it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class ComeraError(Exception):
    """Base class of every error raised by comera."""


class ConfigError(ComeraError, ValueError):
    """A bad setting: sizes, ranks, modes, tau, targets that cannot work together."""


class FactorizationError(ConfigError):
    """A layer size has no usable balanced factorization into tensor modes (e.g. a prime)."""


class ConversionError(ComeraError, ValueError):
    """Converting a model found nothing to convert (no layer matched the selection)."""


class NonFiniteError(ComeraError, FloatingPointError):
    """A training step saw a NaN or infinite value; it was not applied."""


class NonFiniteLossError(NonFiniteError):
    """A training step saw a NaN or infinite loss; it was not applied."""


class NonFiniteGradientError(NonFiniteError):
    """A training step produced NaN or infinite gradients; it was not applied."""


class TrainingStopped(ComeraError, RuntimeError):
    """A run stopped on a fault; the message names the last good checkpoint."""


class CheckpointError(ComeraError, RuntimeError):
    """A checkpoint could not be saved, loaded, or does not match the model it is loaded into."""


class CaptureError(ComeraError, RuntimeError):
    """A captured training step failed inside torch's capture machinery (not in the model's own
    code); the message names the capture mode to use instead."""


class LookupIndexError(ComeraError, IndexError):
    """An embedding id outside ``[0, num_embeddings)``; IndexError, as ``nn.Embedding`` raises."""


class DataFormatError(ComeraError, ValueError):
    """A data file that does not parse: names the file, the line and the field."""


@contextmanager
def tncomp_errors_as_config() -> Iterator[None]:
    """Re-raise a bad-setting error from tncomp (an ``IRError`` or ``OptionError``) as
    :class:`ConfigError` with the same message: the one place comera translates them."""
    from tncomp.errors import IRError, OptionError

    try:
        yield
    except (IRError, OptionError) as exc:
        raise ConfigError(str(exc)) from None
