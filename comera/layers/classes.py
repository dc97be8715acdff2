"""The layer class of a format: which :class:`~comera.layers.linear.GatedLinear` subclass a
linear layer of a given format is (``TTLinear`` for ``"tt"``, ``TTMLinear`` for ``"ttm"``,
``GatedLinear`` for the rest), so a converted layer and one rebuilt from a record are of the
same class."""

from __future__ import annotations

from comera.layers.linear import GatedLinear

__all__ = ["linear_class"]


def linear_class(fmt: str) -> type[GatedLinear]:
    """The linear layer class fixed to the format ``fmt`` (TTLinear for ``"tt"``), or
    GatedLinear when no subclass is: the class ``convert_`` builds and a record rebuilds."""
    todo, seen = list(GatedLinear.__subclasses__()), []
    while todo:
        cls = todo.pop(0)
        seen.append(cls)
        todo += cls.__subclasses__()
    return next((c for c in seen if c.fixed_format == fmt), GatedLinear)
