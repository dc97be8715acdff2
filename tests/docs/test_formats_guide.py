"""docs/formats.md's "Choosing a format" table quotes the committed results it names: the d_model
256 LM frontier (quality, compression, best rate), the GPT step benchmark (step time, memory) and
the equal wall-clock frontier (loss for dense's time against dense and the narrow model).
When a result is re-run, the guide must follow it or this test fails."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
GUIDE_ROWS = {"ttm": "`ttm`", "btt": "`btt`", "tt": "`tt`", "lowrank": "`lowrank`",
              "narrow": "narrower dense model"}
FRONTIER_TITLES = {"ttm": "TT-matrix at a uniform rank (balanced parametrization)",
                   "btt": "block tensor train at a uniform rank (balanced parametrization)",
                   "tt": "TT at a uniform rank (balanced parametrization)",
                   "lowrank": "low-rank at a uniform rank (balanced parametrization)",
                   "narrow": "narrower dense, same size"}


def _table(text: str, marker: str) -> list[list[str]]:
    """The data rows of the first markdown table after ``marker``."""
    rest = text[text.index(marker):]
    rows = []
    for line in rest[rest.index("\n|"):].strip().splitlines():
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows[2:]


def _guide() -> dict[str, list[str]]:
    rows = _table((ROOT / "docs" / "formats.md").read_text(), "## Choosing a format")
    out = {}
    for key, start in GUIDE_ROWS.items():
        matches = [r for r in rows if r[0].startswith(start)]
        assert len(matches) == 1, (key, rows)
        out[key] = matches[0]
    return out


def _frontier_8x() -> dict[str, list[str]]:
    rows = _table((RESULTS / "lm_frontier_d256" / "frontier.md").read_text(), "| target |")
    return {key: next(r for r in rows if r[0] == "8x" and r[1] == title)
            for key, title in FRONTIER_TITLES.items()}


def _step_rows() -> dict[int, dict[str, dict]]:
    by_width = {}
    for name in ("gpt_step_cpu.json", "gpt_step_d256_cpu.json"):
        for width in json.loads((RESULTS / name).read_text())["widths"]:
            by_width[width["d_model"]] = {r["model"]: r for r in width["rows"]}
    return by_width


@pytest.mark.parametrize("key", list(GUIDE_ROWS))
def test_quality_compression_and_rate_are_the_frontiers(key):
    guide, frontier = _guide()[key], _frontier_8x()[key]
    assert guide[1] == frontier[6]  # val vs dense, e.g. "-0.23%"
    assert guide[2] == frontier[9]  # linear compression
    assert float(guide[5].split()[0]) == float(frontier[3].split()[0])  # the chosen rate
    assert frontier[2].startswith("3 ")  # three seeds behind every quality figure


@pytest.mark.parametrize("key", list(GUIDE_ROWS))
def test_step_time_and_memory_are_the_benchmarks(key):
    guide, steps = _guide()[key], _step_rows()
    quoted = [float(x) for x in re.findall(r"([\d.]+)x", guide[3])]
    assert quoted == [round(steps[d][key]["vs_dense"]["ratio"], 2) for d in (128, 256, 512)]
    memory = steps[512][key]["peak_extra_mib"] / steps[512]["dense"]["peak_extra_mib"]
    assert float(guide[4].rstrip("x")) == round(memory, 2)


def _equal_time_8x() -> dict[str, list[str]]:
    text = (RESULTS / "lm_equal_time_d256" / "equal_time.md").read_text()
    rows = _table(text, "## Budget 1 ")
    return {key: next(r for r in rows if r[0] == "8x" and r[1] == title)
            for key, title in FRONTIER_TITLES.items()}


@pytest.mark.parametrize("key", list(GUIDE_ROWS))
def test_the_equal_time_column_is_the_frontiers_whole_budget(key):
    guide, row = _guide()[key], _equal_time_8x()[key]
    assert guide[6] == f"{row[6]} / {row[7]}"  # vs dense / vs narrow
    assert row[2] == "3"  # three seeds behind every figure
