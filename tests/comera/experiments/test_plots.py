"""The experiment plots: the ranks plot tells every layer apart, however many there are."""

from __future__ import annotations

import pytest

from comera.experiments import plots

pytest.importorskip("matplotlib")


def _run(names: list[str]) -> dict:
    return {"name": "comera",
            "ranks": [(step, {n: [8 - step // 10 - k % 3, 6] for k, n in enumerate(names)})
                      for step in range(0, 60, 10)]}


def test_layer_kind_drops_the_numbered_parts():
    assert plots.layer_kind("blocks.3.attn.q") == ("blocks.attn.q", "3")
    assert plots.layer_kind("embeddings.12") == ("embeddings", "12")
    assert plots.layer_kind("tokens") == ("tokens", "")


def test_ranks_figure_labels_every_layer_and_every_kind():
    plt = plots._pyplot()
    names = ["tokens"] + [f"blocks.{b}.{k}" for b in range(4)
                          for k in ("attn.q", "attn.k", "attn.v", "attn.o", "ffn_in", "ffn_out")]
    assert len(names) == 25  # more layers than a 10-colour cycle can tell apart
    fig = plots.ranks_figure(plt, _run(names), {"stage": "both", "steps_early": 30,
                                                "steps_late": 30}, "t")
    try:
        ax_map, ax_kind = fig.axes[:2]
        rows = [t.get_text() for t in ax_map.get_yticklabels()]
        assert sorted(rows) == sorted(names) and len(rows) == len(names)  # one labelled row each
        assert rows[:4] == [f"blocks.{b}.attn.k" for b in range(4)]  # grouped by kind, in order
        legend = [t.get_text() for t in ax_kind.get_legend().get_texts()]
        assert "blocks.attn.q (4 layers)" in legend and "tokens (1 layer)" in legend
        assert len(legend) == 7 + 1  # six block kinds, the embedding, the late-stage marker
    finally:
        plt.close(fig)
