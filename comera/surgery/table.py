"""The plain-text tables comera prints (``convert_``'s report, ``comera report``): one renderer.

Columns are left-aligned and two blanks apart, a rule of dashes sits under the header, trailing
blanks are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence


def text_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """``head`` and ``rows`` (strings, one per column) as aligned lines, a rule under the head."""
    table = [tuple(head), *(tuple(row) for row in rows)]
    widths = [max(len(row[c]) for row in table) for c in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
             for row in table]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return lines


__all__ = ["text_table"]
