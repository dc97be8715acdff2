"""The benchmarks' memory counts: saved-tensor bytes, bytes held after a forward, peak RSS."""

from __future__ import annotations

import pytest
import torch

from benchmarks.lib.memory import held_bytes, peak_rss_delta, rss_available, saved_bytes


def test_saved_bytes_counts_unique_storages_by_hand():
    a = torch.randn(64, 32, requires_grad=True)
    b = torch.randn(32, 16, requires_grad=True)

    def forward():
        # mm saves a and b; the second mm saves a again (counted once), a view of b (the same
        # storage, counted once) and a new tensor 2b (a storage of its own)
        return a @ b + a[:, :] @ b[:, :] + a @ (b * 2)

    counts = saved_bytes(forward)
    assert counts == {"saved": (64 * 32 + 2 * 32 * 16) * 4, "output": 64 * 16 * 4}


def test_held_bytes_sees_what_the_forward_keeps():
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(512, 256)

    def forward():
        h = torch.tanh(x @ w)  # (512, 256)
        return (h * h).sum()  # h * h is freed: mul saves h

    # tanh saves its result h (its input, the mm output, is freed); mm saves x and w, which
    # existed before; the output is one float
    assert held_bytes(forward) == 512 * 256 * 4 + 4


@pytest.mark.skipif(not rss_available(), reason="needs Linux /proc/self/clear_refs")
def test_peak_rss_delta_sees_a_large_touched_allocation():
    n = 64 * 2**20  # 64 MiB, touched, then freed
    delta = peak_rss_delta(lambda: torch.ones(n // 4).sum())
    assert delta >= 0.9 * n
