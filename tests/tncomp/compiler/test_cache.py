"""Plan caches: structural sharing in memory, the bounded LRU, and the checksummed disk cache."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import tncomp
import tncomp.api
import tncomp.compiler.planner
from tests.helpers.tn import F64, compile_net, operands, reference
from tncomp import Dim, Role
from tncomp.compiler.cache import DiskCache, LRUCache
from tncomp.compiler.ir import structural_key


@pytest.fixture(autouse=True)
def _fresh_plan_cache():
    tncomp.clear_cache()
    yield
    tncomp.clear_cache()


def _run(net, batch=3, seed=0, **kw):
    ts = operands(net, batch, seed=seed, **kw)
    y = compile_net(net)(*ts)
    torch.testing.assert_close(y, reference(net, [t.detach() for t in ts]))
    return y


# -- in-memory sharing ------------------------------------------------------------------------

def test_relabelled_einsum_networks_share_one_plan():
    a = tncomp.from_eq("ab,bc->ac", (3, 4), (4, 5))
    b = tncomp.from_eq("xy,yz->xz", (3, 4), (4, 5))
    c = tncomp.from_eq("ab,bc->ac", (3, 4), (4, 5), names=("left", "right"))
    assert structural_key(a) == structural_key(b) == structural_key(c)
    _run(a)
    info = tncomp.cache_info()
    assert (info["misses"], info["hits"], info["plans"]) == (1, 0, 1)
    _run(b, seed=1)
    _run(c, seed=2)
    info = tncomp.cache_info()
    assert (info["misses"], info["hits"], info["plans"]) == (1, 2, 1)


def test_two_builds_of_one_layer_share_one_plan():
    net1 = tncomp.tt_linear([3, 5], [2, 7], 3)
    net2 = tncomp.tt_linear([3, 5], [2, 7], 3, batch=Dim("N"))  # symbol names do not matter
    _run(net1, batch=6)
    _run(net2, batch=6, seed=1)
    info = tncomp.cache_info()
    assert (info["misses"], info["hits"]) == (1, 1)


def test_repeat_calls_hit_the_compiled_networks_own_table():
    net = tncomp.from_eq("ab,bc->ac", (3, 4), (4, 5))
    f = compile_net(net)
    ts = operands(net)
    for _ in range(5):
        f(*ts)
    assert tncomp.cache_info()["misses"] == 1
    assert tncomp.cache_info()["plans"] == 1


@pytest.mark.parametrize("change", ["sizes", "dtype", "requires_grad", "optimize", "structure"])
def test_changes_miss(change):
    base = tncomp.from_eq("ab,bc->ac", (3, 4), (4, 5))
    _run(base)
    assert tncomp.cache_info()["misses"] == 1
    if change == "sizes":
        _run(tncomp.from_eq("ab,bc->ac", (3, 4), (4, 6)))
    elif change == "dtype":
        _run(base, dtype=torch.float32)
    elif change == "requires_grad":
        _run(base, requires_grad=True)
    elif change == "optimize":
        ts = operands(base)
        compile_net(base, optimize="flops")(*ts)
    else:
        _run(tncomp.from_eq("ab,bc->ca", (3, 4), (4, 5)))
    assert tncomp.cache_info()["misses"] == 2
    assert tncomp.cache_info()["plans"] == 2


def test_changed_batch_misses_but_is_then_reused():
    net = tncomp.tt_linear([3, 5], [2, 7], 3)
    f = compile_net(net)
    for b in (4, 9, 4, 9):
        f(*operands(net, b))
    assert tncomp.cache_info()["misses"] == 2


def test_clear_cache_resets_counters():
    _run(tncomp.from_eq("ab,bc->ac", (3, 4), (4, 5)))
    tncomp.clear_cache()
    info = tncomp.cache_info()
    assert (info["plans"], info["hits"], info["misses"]) == (0, 0, 0)


def test_clear_cache_drops_plans_of_live_compiled_networks():
    net = tncomp.tt_linear([12, 8, 8], [8, 8, 12], 8)
    f = compile_net(net)
    ts = operands(net, 64)
    f(*ts)
    assert tncomp.cache_info()["misses"] == 1
    tncomp.clear_cache()
    f(*ts)
    assert tncomp.cache_info()["misses"] == 1  # the plan was built again after the clear


def test_contract_compiles_once_per_equation_and_shapes():
    a, b = torch.randn(3, 4, dtype=F64), torch.randn(4, 5, dtype=F64)
    for _ in range(3):
        torch.testing.assert_close(tncomp.contract("ij,jk->ik", a, b), a @ b)
    assert tncomp.cache_info()["misses"] == 1


def test_size_declaration_order_does_not_collide():
    def net(order):
        sizes = {"a": Dim("A"), "b": 3, "c": Dim("C"), "d": 2}
        return tncomp.make_network(
            [("x", ["a", "b"], Role.INPUT), ("w", ["b", "c", "d"], Role.INPUT)],
            ("y", ["d", "a", "c"]), {k: sizes[k] for k in order})

    gen = torch.Generator().manual_seed(0)
    compile_net(net("abcd"))(torch.randn(2, 3, generator=gen, dtype=F64),
                             torch.randn(3, 5, 2, generator=gen, dtype=F64))
    x = torch.randn(5, 3, generator=gen, dtype=F64)
    w = torch.randn(3, 2, 2, generator=gen, dtype=F64)
    y = compile_net(net("cbad"))(x, w)  # a=5, c=2: the same bound tuple (2, 3, 5, 2)
    torch.testing.assert_close(y, torch.einsum("ab,bcd->dac", x, w))


# -- LRUCache ---------------------------------------------------------------------------------

def test_lru_bound_and_eviction_order():
    cache = LRUCache(maxsize=3)
    built = []

    def get(key):
        return cache.get_or_build(key, lambda: built.append(key) or key.upper())

    for k in "abc":
        assert get(k) == k.upper()
    assert get("a") == "A"  # a becomes most recently used: b is now the oldest
    get("d")
    assert len(cache) == 3
    assert "b" not in cache and all(k in cache for k in "acd")
    get("e")  # evicts c
    assert "c" not in cache and all(k in cache for k in "ade")
    assert built == ["a", "b", "c", "d", "e"]
    assert (cache.hits, cache.misses) == (1, 5)
    get("b")
    assert built[-1] == "b" and len(cache) == 3
    for k in range(100):
        get(str(k))
        assert len(cache) <= 3
    cache.clear()
    assert len(cache) == 0 and cache.hits == cache.misses == 0


def test_lru_of_size_one_and_invalid_size():
    cache = LRUCache(maxsize=1)
    cache.get_or_build(1, lambda: "one")
    cache.get_or_build(2, lambda: "two")
    assert 2 in cache and 1 not in cache and len(cache) == 1
    with pytest.raises(ValueError, match="at least one"):
        LRUCache(maxsize=0)


def test_lru_build_failure_caches_nothing():
    cache = LRUCache(maxsize=2)

    def boom():
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        cache.get_or_build("k", boom)
    assert "k" not in cache and len(cache) == 0
    assert cache.get_or_build("k", lambda: 5) == 5


def test_plan_cache_is_bounded(monkeypatch):
    small = LRUCache(maxsize=2)
    monkeypatch.setattr(tncomp.api, "_RUNNERS", small)
    for n in (3, 4, 5, 6):
        _run(tncomp.from_eq("ab,bc->ac", (3, n), (n, 2)))
    assert len(small) == 2 and small.misses == 4
    assert tncomp.cache_info()["plans"] == 2 and tncomp.cache_info()["maxsize"] == 2


# -- DiskCache --------------------------------------------------------------------------------

KEY = ("tree", (("input", (0, 1)),), 4, (True, False), "search")
PAYLOAD = {"n": 3, "steps": [[0, 1], [2, 3]], "times": [0.5, 1e-6], "note": "é"}


def test_disk_round_trip(tmp_path):
    disk = DiskCache(tmp_path / "nested" / "dir")
    assert disk.load(KEY) is None
    disk.store(KEY, PAYLOAD)
    assert disk.load(KEY) == PAYLOAD
    assert DiskCache(tmp_path / "nested" / "dir").load(KEY) == PAYLOAD  # a fresh instance
    assert len(disk.entries()) == 1
    assert not list((tmp_path / "nested" / "dir").glob(".tmp-*"))  # no temp file left
    other = ("tree", 2)
    disk.store(other, [1, 2])
    assert disk.load(other) == [1, 2] and disk.load(KEY) == PAYLOAD
    assert disk.clear() == 2 and disk.entries() == [] and disk.load(KEY) is None


def _corrupt_garbage(path):
    path.write_bytes(b"\xff\xfe\x00\x9c garbage \x00\x01")


def _corrupt_truncated(path):
    path.write_text(path.read_text()[:-7])


def _corrupt_tampered(path):
    record = json.loads(path.read_text())
    record["payload"]["steps"] = [[1, 0], [2, 3]]  # checksum left stale
    path.write_text(json.dumps(record))


def _corrupt_wrong_version(path):
    record = json.loads(path.read_text())
    record["version"] = 999
    path.write_text(json.dumps(record))


def _corrupt_not_a_record(path):
    path.write_text("[1, 2, 3]")


def _corrupt_empty(path):
    path.write_text("")


@pytest.mark.parametrize("corrupt", [_corrupt_garbage, _corrupt_truncated, _corrupt_tampered,
                                     _corrupt_wrong_version, _corrupt_not_a_record,
                                     _corrupt_empty])
def test_corrupt_entry_reads_as_missing_and_is_rebuilt(tmp_path, corrupt, caplog):
    disk = DiskCache(tmp_path)
    disk.store(KEY, PAYLOAD)
    (path,) = disk.entries()
    corrupt(path)
    with caplog.at_level(logging.WARNING, logger="tncomp.compiler.cache"):
        assert disk.load(KEY) is None
    assert any("rebuilding" in r.getMessage() for r in caplog.records)
    disk.store(KEY, PAYLOAD)
    assert disk.load(KEY) == PAYLOAD
    assert len(disk.entries()) == 1


def test_entry_of_another_key_is_not_trusted(tmp_path):
    disk = DiskCache(tmp_path)
    disk.store(("a",), {"v": 1})
    disk.store(("b",), {"v": 2})
    path_a = disk._path(("a",))
    path_b = disk._path(("b",))
    path_b.write_text(path_a.read_text())  # a valid record, filed under the wrong key
    assert disk.load(("b",)) is None
    assert disk.load(("a",)) == {"v": 1}


def test_unwritable_directory_does_not_raise(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    disk = DiskCache(blocker)
    disk.store(KEY, PAYLOAD)  # logged, not raised
    assert disk.load(KEY) is None
    assert disk.entries() == []


def test_default_directory_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TNCOMP_CACHE_DIR", str(tmp_path / "env-dir"))
    assert DiskCache().directory == tmp_path / "env-dir"
    DiskCache().store(KEY, PAYLOAD)
    assert tncomp.cache_info()["disk_entries"] == 1
    assert tncomp.cache_info()["disk_dir"] == str(tmp_path / "env-dir")
    tncomp.clear_cache(disk=True)
    assert tncomp.cache_info()["disk_entries"] == 0


def _forbid(monkeypatch, name):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} ran although the disk cache held the result")

    monkeypatch.setattr(tncomp.compiler.planner, name, refuse)


def test_regime_table_is_stored_and_reloaded(tmp_path, monkeypatch):
    net = tncomp.tt_linear([3, 5], [2, 7], 3)
    first = tncomp.compile(net, disk_cache=tmp_path).regimes()
    assert len(list(tmp_path.glob("*.json"))) == 1
    _forbid(monkeypatch, "build_regimes")
    again = tncomp.compile(net, disk_cache=tmp_path).regimes()
    assert again == first
    assert again.breakpoints == first.breakpoints
    # a relabelled copy of the layer finds the same entry
    relabel = tncomp.tt_linear([3, 5], [2, 7], 3, batch=Dim("N"))
    table = tncomp.compile(relabel, disk_cache=tmp_path).regimes()
    assert table.regimes == first.regimes and table.dim.name == "N"
    assert len(list(tmp_path.glob("*.json"))) == 1
    # and a call whose binding matches the table (float32, all gradients) uses it
    ts = operands(net, 5, dtype=torch.float32, requires_grad=True)
    torch.testing.assert_close(tncomp.compile(net, disk_cache=tmp_path)(*ts),
                               reference(net, [t.detach() for t in ts]))


def test_corrupt_regime_entry_is_rebuilt(tmp_path, monkeypatch):
    net = tncomp.tt_linear([3, 5], [2, 7], 3)
    first = tncomp.compile(net, disk_cache=tmp_path).regimes()
    (path,) = tmp_path.glob("*.json")
    _corrupt_tampered_regimes(path)
    calls = []
    real = tncomp.compiler.planner.build_regimes
    monkeypatch.setattr(tncomp.compiler.planner, "build_regimes",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    assert tncomp.compile(net, disk_cache=tmp_path).regimes() == first
    assert calls == [1]
    assert tncomp.compile(net, disk_cache=tmp_path).regimes() == first  # rewritten: loads
    assert calls == [1]


def _corrupt_tampered_regimes(path):
    record = json.loads(path.read_text())
    record["payload"]["regimes"][0]["hi"] += 1
    path.write_text(json.dumps(record))


def test_searched_tree_is_stored_and_reloaded(tmp_path, monkeypatch):
    net = tncomp.from_eq("ab,bc,cd,de->ae", (3, 4), (4, 5), (5, 6), (6, 2))
    ts = operands(net)
    y = tncomp.compile(net, disk_cache=tmp_path, optimize="search")(*ts)
    n_files = len(list(tmp_path.glob("*.json")))
    assert n_files == 1
    tncomp.clear_cache()
    _forbid(monkeypatch, "choose_plan")
    y2 = tncomp.compile(net, disk_cache=tmp_path, optimize="search")(*ts)
    torch.testing.assert_close(y2, y)
    assert len(list(tmp_path.glob("*.json"))) == n_files
