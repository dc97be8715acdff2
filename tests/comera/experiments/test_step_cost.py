"""comera.experiments.step_cost measures what its names say: the bytes a step allocates at its
peak, the storages held before it, and it keeps the terminal quiet while profiling."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import comera
from comera.experiments.step_cost import measure_step, peak_allocated_bytes, resident_bytes


def test_the_peak_is_the_most_held_at_once_not_the_sum_allocated():
    def two_in_turn() -> None:
        a = torch.ones(250_000)  # 1 MB
        del a
        b = torch.ones(500_000)  # 2 MB, allocated after the first was freed
        del b

    def two_at_once() -> None:
        a, b = torch.ones(250_000), torch.ones(500_000)
        del a, b

    assert 2_000_000 <= peak_allocated_bytes(two_in_turn) < 2_100_000
    assert 3_000_000 <= peak_allocated_bytes(two_at_once) < 3_100_000


def test_resident_bytes_count_a_shared_storage_once():
    model = torch.nn.Linear(100, 10)  # 1,010 floats
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 100)).sum().backward()
    optimizer.step()  # two moments per parameter, and a step count each
    held = resident_bytes(model, optimizer, [model.weight])  # the weight again: not twice
    floats = 1010 * 4
    assert held == 4 * floats + 2 * 4  # parameters, gradients, two moments, two step counts


def test_profiling_prints_nothing():
    code = ("import torch\nfrom comera.experiments.step_cost import peak_allocated_bytes\n"
            "print(peak_allocated_bytes(lambda: torch.ones(1000) + 1))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=120)
    assert done.stderr == "" and int(done.stdout) >= 8000


def test_a_measured_step_has_its_optimizer_state_resident_and_its_gradients_in_the_peak():
    model = torch.nn.Linear(1000, 100)  # 100,100 floats
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 1000)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).sum().backward()
        optimizer.step()

    cost = measure_step(model, optimizer, step, [x])
    floats = 100_100 * 4
    assert cost.resident_bytes == 3 * floats + 2 * 4 + x.numel() * 4
    assert cost.peak_extra_bytes >= floats  # the gradients, allocated during the step
    assert cost.peak_bytes == cost.resident_bytes + cost.peak_extra_bytes
    assert len(cost.step_ms) == 2 and cost.ms > 0


def test_measure_step_refuses_no_warm_up():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(comera.ConfigError, match="warmup=0"):
        measure_step(model, opt, lambda: None, warmup=0)
