"""Every Python code block in the README and docs/ runs, so the docs cannot rot."""

import re
import warnings

import pytest

from tests.helpers import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [(path.name, k, code) for path in DOCS
          for k, code in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S))]


@pytest.mark.parametrize(("doc", "index", "code"), BLOCKS, ids=[f"{d}-{k}" for d, k, _ in BLOCKS])
def test_code_block_runs(doc, index, code, capsys):
    """Each block runs, and uses nothing that this repository deprecates (a deprecation that
    comera or tncomp raises, or that the block's own line triggers, fails it)."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", DeprecationWarning)
        exec(compile(code, f"{doc}[{index}]", "exec"), {"__name__": "__docs__"})
    ours = (str(ROOT / "comera"), str(ROOT / "tncomp"), f"{doc}[{index}]")
    deprecated = [f"{w.filename}:{w.lineno}: {w.message}" for w in said
                  if issubclass(w.category, DeprecationWarning) and w.filename.startswith(ours)]
    assert not deprecated, deprecated


def test_install_lines_name_what_can_be_installed():
    """Issue 34, item 13: the package is not published, so ``pip install 'tncomp[hf]'`` finds
    nothing; docs and error messages say to install the extras from the checkout."""
    sources = [*DOCS, *sorted((ROOT / "comera").rglob("*.py")),
               *sorted((ROOT / "tncomp").rglob("*.py"))]
    for path in sources:
        assert not re.search(r"pip install \S*'tncomp\[", path.read_text()), path
