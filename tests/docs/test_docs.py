"""Every Python code block in the README and docs/ runs, so the docs cannot rot."""

import re

import pytest

from tests.helpers import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(path.name, k, code) for path in DOCS
          for k, code in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S))]


@pytest.mark.parametrize(("doc", "index", "code"), BLOCKS, ids=[f"{d}-{k}" for d, k, _ in BLOCKS])
def test_code_block_runs(doc, index, code, capsys):
    exec(compile(code, f"{doc}[{index}]", "exec"), {"__name__": "__docs__"})
