"""The four-way frontier tables of docs/results.md (issue 23) quote the committed runs: each
method's mean ± sd over seeds, recomputed from the rows of frontier.json."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MLM_ROWS = {"dense": "dense", "fixed uniform TT rank 15": "tt",
            "fixed uniform TT rank 15, balanced cores (issue 30)": "tt:balanced",
            "low-rank, rank 10": "lowrank-ungated", "CoMERA, early + late": "comera",
            "CoMERA, spectrum": "spectrum"}


def _rows_after(text: str, marker: str) -> list[list[str]]:
    rest = text[text.index(marker):]
    lines = rest[rest.index("\n|"):].strip().splitlines()
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in lines if line.startswith("|")][2:]
    return rows[:next((k for k, line in enumerate(lines) if not line.startswith("|")),
                      len(lines)) - 2]


def _mean_sd(cell: str) -> tuple[float, float]:
    mean, sd = re.search(r"([\d.]+) ± ([\d.]+)", cell.replace("*", "")).groups()
    return float(mean), float(sd)


def test_the_mlm_table_quotes_the_committed_frontier():
    text = (ROOT / "docs" / "results.md").read_text()
    rows = _rows_after(text, "([table](../benchmarks/results/mlm_frontier/frontier.md)")
    committed = json.loads((ROOT / "benchmarks/results/mlm_frontier/frontier.json").read_text())
    assert [r[0] for r in rows] == list(MLM_ROWS)
    for cells in rows:
        losses = [r["test"]["loss"] for r in committed["rows"]
                  if r["method"] == MLM_ROWS[cells[0]] and r["target"] in (None, 8.0)]
        assert len(losses) == 3, cells
        assert _mean_sd(cells[1]) == (round(statistics.fmean(losses), 4),
                                      round(statistics.stdev(losses), 4)), cells
