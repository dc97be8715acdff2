"""Plans carry their peak bytes, and a network whose every plan needs more memory than a limit
is refused before anything is allocated (issue 34, item 9).

A random 3-regular graph of bond-8 cores has intermediates that grow exponentially with the
graph: its best plan asked for gigabytes at the first call, found
only when the allocator failed. The limit is ``compile(..., memory_limit=)``, else
``$TNCOMP_MEMORY_LIMIT``, else half of the device's memory.
"""

from __future__ import annotations

import random

import pytest
import torch

import tncomp
from tests.helpers.tn import reference
from tncomp.compiler.device_model import CPU_DEFAULT
from tncomp.compiler.memory import MEMORY_LIMIT_ENV
from tncomp.compiler.problem import problem_for
from tncomp.compiler.search import choose_plan
from tncomp.errors import MemoryLimitError, OptionError, PlanError


def regular(n: int, seed: int = 0, bond: int = 8) -> tncomp.Network:
    """``n`` cores on a random 3-regular graph (a seeded configuration model), contracted to a
    scalar: the network of issue 34, whose intermediates grow with the graph."""
    rng = random.Random(seed)
    while True:
        stubs = [k for k in range(n) for _ in range(3)]
        rng.shuffle(stubs)
        edges = [tuple(sorted(stubs[j:j + 2])) for j in range(0, len(stubs), 2)]
        if all(a != b for a, b in edges) and len(set(edges)) == len(edges):
            break
    names = {e: f"e{j}" for j, e in enumerate(edges)}
    cores = [(f"t{k}", [names[e] for e in edges if k in e], tncomp.Role.PARAMETER)
             for k in range(n)]
    return tncomp.make_network(cores, ("y", []), dict.fromkeys(names.values(), bond))


def _cores(net: tncomp.Network) -> list[torch.Tensor]:
    sizes = net.size_dict
    return [torch.full(tuple(sizes[i] for i in t.indices), 0.5, dtype=torch.float64)
            for t in net.operands]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(MEMORY_LIMIT_ENV, raising=False)
    tncomp.clear_cache()
    yield
    tncomp.clear_cache()


def test_a_plan_over_the_limit_is_refused_before_it_runs(monkeypatch):
    net = regular(24)
    compiled = tncomp.compile(net, memory_limit=2**20, disk_cache=False)
    ran = []
    monkeypatch.setattr(torch, "mm", lambda *a, **k: ran.append(a))  # nothing may run
    with pytest.raises(MemoryLimitError, match=r"limit of 1\.00 MiB.*memory='min'.*memory_limit="):
        compiled(*_cores(net))
    assert not ran
    assert issubclass(MemoryLimitError, PlanError) and issubclass(MemoryLimitError, MemoryError)


def test_the_environment_sets_the_limit_and_the_option_overrides_it(monkeypatch):
    net = regular(24)
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(2**20))
    with pytest.raises(MemoryLimitError, match=rf"\${MEMORY_LIMIT_ENV}"):
        tncomp.compile(net, disk_cache=False)(*_cores(net))
    big = tncomp.compile(net, memory_limit=2**40, disk_cache=False)
    y = big(*_cores(net))
    assert torch.isfinite(y)
    assert big.plan_of(*_cores(net)).peak_bytes > 2**20


def test_the_default_limit_is_half_the_device_memory():
    compiled = tncomp.compile(regular(6), disk_cache=False)
    from tncomp.runtime.device_timing import device_memory

    total = device_memory("cpu")
    assert total is not None and compiled.memory_limit("cpu") == total // 2


@pytest.mark.parametrize("bad", [0, -5, 1.5, "8GB", True])
def test_a_bad_limit_is_an_option_error_naming_it(bad, monkeypatch):
    with pytest.raises(OptionError, match="memory_limit="):
        tncomp.compile(regular(6), memory_limit=bad)
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(bad))
    with pytest.raises(OptionError, match=MEMORY_LIMIT_ENV):
        tncomp.compile(regular(6))


def test_a_plan_over_the_limit_gives_way_to_a_leaner_candidate():
    """The least modelled time is not the least memory: under a limit between the two the
    planner takes the fastest candidate that fits, with einsum's results and gradients."""
    net = regular(10)
    ops = _cores(net)
    for t in ops:
        t.requires_grad_()
    problem = problem_for(net)
    choice = choose_plan(problem, (True,) * 10, 8, CPU_DEFAULT)
    limit = min(p.peak_bytes for p in choice.plans)
    assert choice.plan.peak_bytes > limit  # the fastest plan does not fit
    limited = tncomp.compile(net, memory_limit=limit, model=CPU_DEFAULT, disk_cache=False)
    assert limited.plan_of(*ops).peak_bytes <= limit
    y = limited(*ops)
    expected = reference(net, ops)
    torch.testing.assert_close(y, expected)
    for got, want in zip(torch.autograd.grad(y, ops), torch.autograd.grad(expected, ops),
                         strict=True):
        torch.testing.assert_close(got, want)
