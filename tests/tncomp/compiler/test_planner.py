"""The planner: tree payloads, keys, the reuse of the search's plan, and malformed disk entries.

A checksum-valid but malformed plan-cache entry (a tree over the wrong number of leaves, a str
where an int belongs, an empty regime list, ...) is logged and rebuilt, never trusted: it used
to crash every later compile of that network until ``tncomp cache clear``.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

import tncomp
import tncomp.compiler.planner as planner_module
from tests.helpers.tn import operands, reference
from tncomp.compiler.cache import DiskCache, _checksum
from tncomp.compiler.device_model import CPU_DEFAULT
from tncomp.compiler.planner import Options, Planner, binding_key
from tncomp.compiler.problem import Tree
from tncomp.errors import CacheError

CHAIN = ("ab,bc,cd,de->ae", (3, 4), (4, 5), (5, 6), (6, 2))


@pytest.fixture(autouse=True)
def _fresh_plans():
    tncomp.clear_cache()
    yield
    tncomp.clear_cache()


def _rewrite_payload(path, payload) -> None:
    """Replace an entry's payload, keeping the record checksum-valid (as a buggy writer or an
    older format would)."""
    record = json.loads(path.read_text())
    record["payload"] = payload
    record["checksum"] = _checksum(payload)
    path.write_text(json.dumps(record))


def _check_rebuilt(net, tmp_path, caplog, batch=2, **options):
    """Compile again over the malformed entry: a correct result, one warning, and the entry
    rewritten (a third compile reads it without a warning)."""
    tncomp.clear_cache()
    ts = operands(net, batch)
    with caplog.at_level(logging.WARNING, logger="tncomp.compiler.cache"):
        y = tncomp.compile(net, disk_cache=tmp_path, **options)(*ts)
    torch.testing.assert_close(y, reference(net, ts))
    assert "malformed entry" in caplog.text
    caplog.clear()
    tncomp.clear_cache()
    with caplog.at_level(logging.WARNING, logger="tncomp.compiler.cache"):
        tncomp.compile(net, disk_cache=tmp_path, **options)(*ts)
    assert "malformed" not in caplog.text


# -- Tree payloads ----------------------------------------------------------------------------

def test_tree_payload_round_trip():
    tree = Tree(4, ((0, 1), (2, 3), (4, 5)))
    assert Tree.from_payload(tree.to_payload()) == tree
    assert Tree.from_payload(json.loads(json.dumps(tree.to_payload())), n_leaves=4) == tree


@pytest.mark.parametrize("payload, message", [
    ([[0, 1]], "expected {'n'"),
    ({"n": 4}, "expected {'n'"),
    ({"n": "4", "steps": [[0, 1], [2, 3], [4, 5]]}, "n='4'"),
    ({"n": True, "steps": []}, "n=True"),
    ({"n": 3, "steps": [[0, 1], [2, 3]]}, "over 3 leaves; the network has 4"),
    ({"n": 4, "steps": [[0, "1"], [2, 3], [4, 5]]}, "[int, int] pairs"),
    ({"n": 4, "steps": [[0, 1, 2], [2, 3], [4, 5]]}, "[int, int] pairs"),
    ({"n": 4, "steps": [[0, 0], [1, 2], [3, 4]]}, "invalid"),
    ({"n": 4, "steps": [[0, 1]]}, "invalid"),
])
def test_malformed_tree_payload_is_a_cache_error(payload, message):
    with pytest.raises(CacheError) as info:
        Tree.from_payload(payload, n_leaves=4)
    assert message in str(info.value)


# -- malformed disk entries are rebuilt -------------------------------------------------------

@pytest.mark.parametrize("payload", [
    {"n": 3, "steps": [[0, 1], [2, 3]]},  # a valid tree over the wrong number of leaves
    {"n": "4", "steps": [[0, 1], [2, 3], [4, 5]]},  # a str where an int belongs
    {"n": 4, "steps": [[0, 0], [1, 2], [3, 4]]},  # a node used twice
    {"n": 4, "steps": [[0, 1], [2, 3], [4, 9]]},  # a node that does not exist
    ["not", "a", "tree"],
])
def test_malformed_searched_tree_is_rebuilt(tmp_path, caplog, payload):
    net = tncomp.from_eq(*CHAIN)
    tncomp.compile(net, disk_cache=tmp_path, optimize="search")(*operands(net))
    (path,) = tmp_path.glob("*.json")
    _rewrite_payload(path, payload)
    _check_rebuilt(net, tmp_path, caplog, optimize="search")


def _regime_payload(tmp_path, net):
    tncomp.compile(net, disk_cache=tmp_path).regimes((False,) * 5, 8)  # as operands() binds
    (path,) = tmp_path.glob("*.json")
    return path, json.loads(path.read_text())["payload"]


def _mutations():
    def tree_of_three(p):
        p["regimes"][0]["tree"] = {"n": 3, "steps": [[0, 1], [2, 3]]}

    def str_bound(p):
        p["regimes"][0]["hi"] = str(p["regimes"][0]["hi"])

    def gap(p):
        p["regimes"][0]["lo"] += 1

    def short(p):
        p["regimes"][-1]["hi"] -= 1

    def empty(p):
        p["regimes"] = []

    def flat_list(p):
        p["regimes"] = [[1, 5, 5, [[0, 1]]]]

    return [tree_of_three, str_bound, gap, short, empty, flat_list]


@pytest.mark.parametrize("mutate", _mutations(), ids=lambda f: f.__name__)
def test_malformed_regime_table_is_rebuilt(tmp_path, caplog, mutate):
    net = tncomp.tt_linear([3, 5], [2, 7], 3)
    path, payload = _regime_payload(tmp_path, net)
    mutate(payload)
    _rewrite_payload(path, payload)
    _check_rebuilt(net, tmp_path, caplog, batch=3)


def test_malformed_autotuned_tree_is_rebuilt(tmp_path, caplog):
    net = tncomp.from_eq(*CHAIN)
    tncomp.compile(net, disk_cache=tmp_path, optimize="search", autotune=True)(*operands(net))
    paths = sorted(tmp_path.glob("*.json"))
    entries = {p: json.loads(p.read_text())["payload"] for p in paths}
    (tuned,) = [p for p, payload in entries.items() if "times" in payload]
    _rewrite_payload(tuned, {"tree": {"n": 2, "steps": [[0, 1]]}, "times": [1.0]})
    _check_rebuilt(net, tmp_path, caplog, optimize="search", autotune=True)


# -- keys and reuse ---------------------------------------------------------------------------

def test_relabelled_networks_share_disk_keys(tmp_path):
    """Disk keys hold the bound sizes in canonical index order, not by label."""
    disk = DiskCache(tmp_path)
    a = Planner(tncomp.from_eq("ab,bc,cd->ad", ("B", 3), (3, 4), (4, 5)), Options(), disk)
    b = Planner(tncomp.from_eq("xy,yz,zw->xw", ("N", 3), (3, 4), (4, 5)), Options(), disk)
    grads = (True, True, True)
    sizes_a = {"a": 2, "b": 3, "c": 4, "d": 5}
    sizes_b = {"x": 2, "y": 3, "z": 4, "w": 5}
    for key in ("tree_key", "memory_key"):
        args = (grads, 4, CPU_DEFAULT) if key == "tree_key" else ("float32", "cpu", grads,
                                                                  CPU_DEFAULT)
        assert getattr(a, key)(sizes_a, *args) == getattr(b, key)(sizes_b, *args)
        assert getattr(a, key)(sizes_a, *args) != getattr(a, key)({**sizes_a, "a": 7}, *args)
    assert a.autotune_key(sizes_a, grads, "float32", "cpu") == b.autotune_key(
        sizes_b, grads, "float32", "cpu")


def test_runners_on_two_gpus_do_not_share_a_key():
    """A runner's pooled buffers live on one device: cuda:0 and cuda:1 need their own runners
    (the key once held only the device type)."""
    planner = Planner(tncomp.from_eq("bi,ij->bj", ("B", 3), (3, 4)), Options(), None)
    sizes = {"b": 2, "i": 3, "j": 4}
    keys = {planner.memory_key(sizes, "float32", device, (True, True), CPU_DEFAULT)
            for device in ("cuda:0", "cuda:1", "cpu")}
    assert len(keys) == 3


def test_search_plan_is_not_lowered_again(monkeypatch):
    """The plan the search chose is the plan that runs: each candidate is lowered once."""
    net = tncomp.from_eq(*CHAIN)
    lowered = []
    real = planner_module.lower
    monkeypatch.setattr(planner_module, "lower", lambda *a, **k: lowered.append(1) or real(*a, **k))
    compiled = tncomp.compile(net, disk_cache=False, optimize="search")
    ts = operands(net)
    torch.testing.assert_close(compiled(*ts), reference(net, ts))
    assert lowered == []


def test_hot_path_uses_the_binding_key(monkeypatch):
    """The call's inline key is ``binding_key``: a repeated call finds its runner, no rebuild."""
    net = tncomp.from_eq("bi,ij->bj", ("B", 3), (3, 4))
    compiled = tncomp.compile(net, disk_cache=False)
    builds = []
    real = compiled.runner_for
    monkeypatch.setattr(compiled, "runner_for", lambda *a: builds.append(1) or real(*a))
    for grad in (True, False):
        ts = operands(net, 5, requires_grad=[False, True])
        with torch.set_grad_enabled(grad):
            for _ in range(3):
                compiled(*ts)
        assert binding_key(ts, grad) in compiled._local
    assert len(builds) == 2


def test_planner_takes_values_not_torch():
    """Plans are built from sizes, item size and a device model alone."""
    net = tncomp.tt_linear([3, 5], [2, 7], 3)
    planner = Planner(net, Options(), None)
    sizes = {i: (8 if isinstance(s, tncomp.Dim) else s) for i, s in net.sizes}
    plan = planner.plan_for(sizes, (False,) + (True,) * 4, 8, CPU_DEFAULT)
    assert plan.itemsize == 8 and plan.needs_grad == (False,) + (True,) * 4
    assert plan.tree == planner.regimes((False,) + (True,) * 4, 8, CPU_DEFAULT).tree_for(8)
