"""The engine's CPU thread count: timed at the start (the faster of 1 and all), or given."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from comera import ConfigError
from comera.experiments.engine import EngineConfig, train_model
from comera.training.trainers import pick_threads
from tests.helpers.toy_task import ToyTask


@pytest.mark.parametrize("slow, fast", [(2, 1), (1, 2)])
def test_pick_threads_keeps_the_faster_count(slow, fast):
    def step():  # a step whose cost depends on the thread count it runs at
        time.sleep(0.02 if torch.get_num_threads() == slow else 0.001)

    before = torch.get_num_threads()
    try:
        assert pick_threads(step, (1, 2), repeats=2) == fast
        assert torch.get_num_threads() == fast
    finally:
        torch.set_num_threads(before)


def test_bad_thread_counts_are_refused():
    with pytest.raises(ConfigError, match="thread counts"):
        pick_threads(lambda: None, (0, 2))
    with pytest.raises(ConfigError, match="threads=-1"):
        EngineConfig(threads=-1)


@pytest.mark.parametrize("threads", [0, 1])
def test_the_thread_probe_leaves_the_run_unchanged(tmp_path, threads, monkeypatch):
    """Picking the count runs forward+backward passes; they leave no gradient and no RNG
    trace, so a run that probed ends where a run told its count does (both end at 1 thread
    here: the probe runs at 1 and 2 threads and the test forces 1 for the comparison)."""
    cfg = EngineConfig(steps_early=4, steps_late=0, batch_size=8, lr=1e-2, eval_every=10,
                       stage="early", threads=1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        rng = torch.get_rng_state()
        given, _ = train_model(ToyTask(), "given", cfg, tmp_path / "a")
        torch.set_rng_state(rng)
        probed_cfg = replace(cfg, threads=threads)
        if threads == 0:  # the probe, then train at 1 thread for a bit-comparable run
            torch.set_num_threads(2)
            import comera.experiments.engine as engine

            chosen = []
            monkeypatch.setattr(engine, "pick_threads", lambda step: chosen.append(
                pick_threads(step)) or torch.set_num_threads(1))
            probed, _ = train_model(ToyTask(), "probed", probed_cfg, tmp_path / "b")
            assert chosen and chosen[0] in (1, 2)
        else:
            probed, _ = train_model(ToyTask(), "probed", probed_cfg, tmp_path / "b")
        for (n, a), (_, b) in zip(given.state_dict().items(), probed.state_dict().items(),
                                  strict=True):
            assert torch.equal(a, b), n
    finally:
        torch.set_num_threads(before)


def test_a_resumed_run_keeps_the_thread_count_it_was_checkpointed_with(tmp_path, monkeypatch):
    """CPU reductions split work by thread, so a resumed run must not re-probe its way to
    another count: it takes the checkpoint's, and a run split in two ends bit-identical to
    one run through."""
    import comera.experiments.engine as engine

    cfg = EngineConfig(steps_early=6, steps_late=0, batch_size=8, lr=1e-2, eval_every=10,
                       stage="early", checkpoint_every=3)
    before = torch.get_num_threads()
    probes = []
    monkeypatch.setattr(engine, "pick_threads", lambda step: probes.append(1) or
                        torch.set_num_threads(1))
    try:
        torch.set_num_threads(2)
        rng = torch.get_rng_state()
        whole, _ = train_model(ToyTask(), "m", cfg, tmp_path / "whole")
        torch.set_rng_state(rng)
        torch.set_num_threads(2)
        train_model(ToyTask(), "m", cfg, tmp_path / "split", stop_after=3)
        assert probes == [1, 1]
        torch.set_num_threads(2)  # a resumed process starts at the machine's default again
        resumed, _ = train_model(ToyTask(), "m", cfg, tmp_path / "split", resume=True)
        assert probes == [1, 1], "the resumed run probed again instead of keeping its count"
        assert torch.get_num_threads() == 1
        for (n, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items(),
                                  strict=True):
            assert torch.equal(a, b), n
    finally:
        torch.set_num_threads(before)
