"""The layer class of a format: which :class:`~comera.layers.linear.GatedLinear` class a linear
layer of a given format is (``TTLinear`` for ``"tt"``, ``TTMLinear`` for ``"ttm"``,
``GatedLinear`` for the rest), so a converted layer and one rebuilt from a record are of the
same class. An explicit table (:data:`LINEAR_CLASSES`), not a walk over subclasses: a class
defined somewhere does not change what ``convert_`` builds unless it is registered."""

from __future__ import annotations

from comera.errors import ConfigError
from comera.layers.linear import GatedLinear, TTLinear, TTMLinear

__all__ = ["LINEAR_CLASSES", "linear_class", "register_linear_class"]

#: format name -> the linear class fixed to it (formats not listed: GatedLinear)
LINEAR_CLASSES: dict[str, type[GatedLinear]] = {cls.fixed_format: cls
                                               for cls in (TTLinear, TTMLinear)}


def linear_class(fmt: str) -> type[GatedLinear]:
    """The linear layer class fixed to the format ``fmt`` (TTLinear for ``"tt"``), or
    GatedLinear when none is: the class ``convert_`` builds and a record rebuilds."""
    return LINEAR_CLASSES.get(fmt, GatedLinear)


def register_linear_class(cls: type[GatedLinear]) -> type[GatedLinear]:
    """Make ``cls`` (a GatedLinear subclass with a ``fixed_format``) the class ``convert_``
    builds and records rebuild for its format; usable as a class decorator. Both build it by
    GatedLinear's own paths (``GatedLinear.__init__``, ``from_layout``), so its constructor
    may have any signature."""
    if not (isinstance(cls, type) and issubclass(cls, GatedLinear) and cls.fixed_format):
        raise ConfigError(f"register_linear_class takes a GatedLinear subclass with a "
                          f"fixed_format, got {cls!r}.")
    LINEAR_CLASSES[cls.fixed_format] = cls
    return cls
