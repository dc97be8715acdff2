"""One text-table renderer (comera.surgery.table) for convert_'s report and `comera report`."""

from __future__ import annotations

import inspect

from comera.surgery import convert, report
from comera.surgery.table import text_table


def test_columns_align_under_a_rule_without_trailing_blanks():
    lines = text_table(("layer", "ratio"), [("fc", "2.0x"), ("encoder.0", "")])
    assert lines == ["layer      ratio",
                     "----------------",
                     "fc         2.0x",
                     "encoder.0"]


def test_both_tables_use_the_one_renderer():
    for module in (convert, report):
        source = inspect.getsource(module)
        assert "text_table(" in source and ".ljust(" not in source, module.__name__
