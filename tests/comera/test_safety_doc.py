"""docs/safety.md's threat model: every promise names a test, and every named test exists."""

from __future__ import annotations

import re

from tests.helpers import ROOT

DOC = ROOT / "docs" / "safety.md"
REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def _threat_model() -> dict[str, str]:
    """Section title -> text of the "### " sections under "## Who may write which folder"."""
    text = DOC.read_text()
    part = text.split("## Who may write which folder", 1)[1].split("\n## ", 1)[0]
    sections = re.split(r"^### (.+)$", part, flags=re.M)
    return dict(zip(sections[1::2], sections[2::2], strict=True))


def test_every_test_the_threat_model_names_exists():
    refs = REF.findall(DOC.read_text())
    assert len(refs) >= 15
    for path, name in refs:
        source = (ROOT / path).read_text()
        assert re.search(rf"^def {name}\(", source, flags=re.M), f"{path}::{name} is gone"


def test_every_promise_of_the_comera_folders_names_its_test():
    sections = _threat_model()
    assert {"The run folder", "Checkpoints", "The data cache"} <= {
        title.split(" (")[0] for title in sections}
    for title, text in sections.items():
        if title.startswith(("The plan cache", "`comera convert")):
            continue  # the plan cache's paragraph comes from tncomp; convert: the table below
        bullets = [b for b in re.split(r"^- ", text, flags=re.M)[1:]
                   if not b.startswith("What ")]  # "what a writer can still do": no promise
        for bullet in bullets:
            assert REF.search(bullet), f"{title}: a promise without a test: {bullet[:80]}"
