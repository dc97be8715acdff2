"""The data loaders' tensor cache (comera.data.cache): weights-only reads, so a planted pickle never
runs; damaged or foreign files are rebuilt; writes are atomic and sweep dead writers' temp files."""

from __future__ import annotations

import ast
import logging
import os
import time

import pytest
import torch

from comera.data import cache, stdlib_pairs
from tests.helpers import ROOT
from tncomp.files import TEMP_SUFFIX


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COMERA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("COMERA_NO_PROGRESS", "1")


class _Planted:
    """A pickle that, when unpickled with weights_only=False, creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def _plant(path, marker):
    torch.save({"vocab": _Planted(marker), "train": {"ids": torch.zeros(1)}}, path)


def test_a_planted_pickle_is_refused_before_it_runs(tmp_path, caplog):
    path = cache.cache_file("anything", 1, {"n": 1})
    path.parent.mkdir(parents=True)
    marker = tmp_path / "ran"
    _plant(path, marker)
    with caplog.at_level(logging.WARNING, logger="comera.data"):
        assert cache.read_cached(path) is None
    assert not marker.exists()
    assert "rebuilding corrupt data cache" in caplog.text
    assert "the Python object exec" in caplog.text


def _few_functions(root=None):
    return [(f"mod{k}.py", f"Return the {k} thing.", f"def f{k}(x):\n    return x + {k}")
            for k in range(200)]


def test_stdlib_pairs_rebuilds_over_a_planted_pickle(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(stdlib_pairs, "stdlib_functions", _few_functions)
    first = stdlib_pairs.load_stdlib_pairs(max_len=16, vocab_size=64)
    files = list((tmp_path / "cache").glob("stdlib_pairs-*.pt"))
    assert len(files) == 1
    marker = tmp_path / "ran"
    _plant(files[0], marker)
    with caplog.at_level(logging.WARNING, logger="comera.data"):
        again = stdlib_pairs.load_stdlib_pairs(max_len=16, vocab_size=64)
    assert not marker.exists()
    assert "rebuilding corrupt data cache" in caplog.text
    assert torch.equal(first[0].ids, again[0].ids) and first[3] == again[3]
    cached = stdlib_pairs.load_stdlib_pairs(max_len=16, vocab_size=64)  # rewritten: a hit
    assert torch.equal(cached[1].labels, first[1].labels)


def test_a_foreign_file_is_rebuilt(caplog):
    path = cache.cache_file("anything", 1, {"n": 2})
    path.parent.mkdir(parents=True)
    torch.save({"unrelated": torch.ones(2)}, path)
    with caplog.at_level(logging.WARNING, logger="comera.data"):
        assert cache.read_cached(path, lambda blob: blob["vocab"]) is None
    assert "not a checksummed comera data cache" in caplog.text
    cache.write_cached(path, {"unrelated": torch.ones(2)})  # ours, but decode rejects it
    with caplog.at_level(logging.WARNING, logger="comera.data"):
        assert cache.read_cached(path, lambda blob: blob["vocab"]) is None
    assert "KeyError" in caplog.text


def _temp_file(directory, name, age_s):
    tmp = directory / f".{name}.4242-{'0' * 16}{TEMP_SUFFIX}"
    tmp.write_bytes(b"x" * 100)
    when = time.time() - age_s
    os.utime(tmp, (when, when))
    return tmp


def test_writes_are_atomic_and_sweep_dead_writers_temp_files(tmp_path):
    path = cache.cache_file("thing", 1, {"n": 3})
    path.parent.mkdir(parents=True)
    stale = _temp_file(path.parent, "old.pt", cache.STALE_TEMP_S + 60)
    fresh = _temp_file(path.parent, "new.pt", 1)  # a concurrent writer's, in flight
    cache.write_cached(path, {"ids": torch.arange(4), "vocab": ["a", "b"]})
    assert not stale.exists() and fresh.exists()
    blob = cache.read_cached(path)
    assert torch.equal(blob["ids"], torch.arange(4)) and blob["vocab"] == ["a", "b"]
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, fresh.name])


def test_a_failed_write_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be")
    with caplog.at_level(logging.WARNING, logger="comera.data"):
        cache.write_cached(cache.cache_file("thing", 1, {}), {"ids": torch.zeros(1)})
    assert "could not write the data cache" in caplog.text


def test_every_torch_load_is_weights_only_and_writes_go_through_tncomp_files():
    """Static: every torch.load in comera/ and tncomp/ passes weights_only=True, except the
    convert command, which unpickles a whole model (documented as needing trusted input); no
    comera module renames files itself (atomic writes live in tncomp.files)."""
    trusted = {"comera/cli.py"}
    unsafe, renames = [], []
    for package in ("comera", "tncomp"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                    continue
                owner = getattr(node.func.value, "id", None)
                if (owner, node.func.attr) == ("torch", "load") and rel not in trusted:
                    flags = {k.arg: getattr(k.value, "value", None) for k in node.keywords}
                    if flags.get("weights_only") is not True:
                        unsafe.append(f"{rel}:{node.lineno}")
                if (owner, node.func.attr) == ("os", "replace") and package == "comera":
                    renames.append(f"{rel}:{node.lineno}")
    assert not unsafe, f"torch.load without weights_only=True: {unsafe}"
    assert not renames, f"os.replace outside tncomp.files: {renames}"
