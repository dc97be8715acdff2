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


def test_install_lines_name_what_can_be_installed():
    """Issue 34, item 13: the package is not published, so ``pip install 'tncomp[hf]'`` finds
    nothing; docs and error messages say to install the extras from the checkout."""
    sources = [*DOCS, *sorted((ROOT / "comera").rglob("*.py"))]
    for path in sources:
        assert not re.search(r"pip install \S*'tncomp\[", path.read_text()), path
