"""The on-disk cache shared by several processes, and what a crash mid-write leaves behind.

Real processes throughout. The fast tests load ``tncomp/cache.py`` on its own (it imports only
the standard library), so four writers start in milliseconds; the slow test runs four full
``tncomp.compile`` processes on one ``TNCOMP_CACHE_DIR``. A crash is a child that dies with
``os._exit`` at a chosen point of ``DiskCache.store``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import tncomp
import tncomp.compiler.planner
from tests.helpers import ROOT
from tests.helpers.tn import operands, reference
from tncomp.compiler.cache import STALE_TEMP_S, TEMP_PREFIX, DiskCache

CACHE_PY = ROOT / "tncomp" / "compiler" / "cache.py"
N_PROCS = 4

# Loads tncomp/cache.py as a stand-alone module (no torch import), with warnings on stderr.
PRELUDE = textwrap.dedent("""
    import importlib.util, json, logging, os, sys, time
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    spec = importlib.util.spec_from_file_location("tncomp_cache_alone", {cache_py!r})
    cache = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cache)
""")


def _script(body: str) -> str:
    return PRELUDE.format(cache_py=str(CACHE_PY)) + textwrap.dedent(body)


def _payload(writer: int, rnd: int) -> dict:
    """Payloads of different sizes per writer, so an interleaved write could not parse."""
    return {"writer": writer, "round": rnd, "data": [writer * 1000 + rnd] * (2000 + 700 * writer)}


HAMMER = """
    directory, writer, rounds, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    disk = cache.DiskCache(directory)

    def payload(w, r):
        return {"writer": w, "round": r, "data": [w * 1000 + r] * (2000 + 700 * w)}

    while not os.path.exists(go):  # start together
        time.sleep(0.002)
    seen = missing = 0
    for r in range(rounds):
        for key in (("shared", 0), ("shared", 1)):
            disk.store(key, payload(writer, r))
            got = disk.load(key)
            if got is None:
                missing += 1
                continue
            if got != payload(got["writer"], got["round"]):
                sys.exit("a load returned a mixed or damaged payload")
            seen += 1
        if writer == 0 and r % 10 == 5:
            disk.clear()  # entries vanish under the other readers and writers
    print(json.dumps({"writer": writer, "seen": seen, "missing": missing}))
"""


def _start(script: str, *args, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_four_processes_store_and_load_one_key_concurrently(tmp_path):
    directory, go = tmp_path / "cache", tmp_path / "go"
    rounds = 30
    procs = [_start(_script(HAMMER), directory, w, rounds, go) for w in range(N_PROCS)]
    time.sleep(0.3)  # let every interpreter start, then release them at once
    go.touch()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert "WARNING" not in err, err  # no reader ever met a torn or corrupt entry
        results.append(json.loads(out))
    assert sum(r["seen"] for r in results) >= N_PROCS * rounds  # loads did return payloads
    disk = DiskCache(directory)
    for key in (("shared", 0), ("shared", 1)):
        got = disk.load(key)
        assert got == _payload(got["writer"], rounds - 1)  # some writer's last round won
    assert len(disk.entries()) == 2
    assert disk.temp_files() == []  # every temp file was renamed or swept


def _crash_in_store(tmp_path, where: str) -> tuple[DiskCache, subprocess.CompletedProcess]:
    """A child stores a first payload, then dies inside the second store at ``where``."""
    script = _script(f"""
        disk = cache.DiskCache(sys.argv[1])
        disk.store(("k",), {{"n": 1, "data": list(range(5000))}})
        real_fdopen = os.fdopen
        if {where!r} == "before-rename":  # the temp file is complete and synced: die now
            os.fsync = lambda fd: os._exit(9)
        else:  # die with half the record written
            class Half:
                def __init__(self, fh):
                    self.fh = fh
                def __enter__(self):
                    return self
                def __exit__(self, *exc):
                    return False
                def write(self, data):
                    self.fh.write(data[: len(data) // 2])
                    self.fh.flush()
                    os._exit(9)
            os.fdopen = lambda fd, mode: Half(real_fdopen(fd, mode))
        disk.store(("k",), {{"n": 2, "data": list(range(7000))}})
        sys.exit("not reached")
    """)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    return DiskCache(tmp_path), done


@pytest.mark.parametrize("where", ["before-rename", "mid-write"])
def test_crash_mid_store_leaves_the_old_entry_and_a_temp_that_is_never_read(tmp_path, where,
                                                                            caplog):
    disk, done = _crash_in_store(tmp_path, where)
    assert done.returncode == 9, done.stderr
    (temp,) = disk.temp_files()  # the dead writer's temp file
    assert temp.name.startswith(f"{TEMP_PREFIX}") and temp.suffix == ".part"
    assert len(disk.entries()) == 1  # the temp file is not an entry
    assert disk.load(("k",)) == {"n": 1, "data": list(range(5000))}  # the old entry, intact
    # A fresh temp file might belong to a live writer: the next store leaves it alone ...
    disk.store(("other",), [1])
    assert disk.temp_files() == [temp]
    # ... a stale one is swept by the next store, with a warning.
    old = time.time() - 2 * STALE_TEMP_S
    os.utime(temp, (old, old))
    with caplog.at_level(logging.WARNING, logger="tncomp.compiler.cache"):
        disk.store(("k",), {"n": 3})
    assert disk.temp_files() == []
    assert any("interrupted write" in r.getMessage() for r in caplog.records)
    assert disk.load(("k",)) == {"n": 3}


def test_temp_file_holding_a_valid_record_is_not_loaded(tmp_path):
    disk = DiskCache(tmp_path)
    disk.store(("k",), {"v": 1})
    (entry,) = disk.entries()
    entry.rename(tmp_path / f"{TEMP_PREFIX}123-abc.part")  # as if the rename never happened
    assert disk.load(("k",)) is None
    assert disk.entries() == []
    assert disk.clear() == 0 and disk.temp_files() == []  # clear also removes temp files


def test_calibration_and_foreign_files_are_not_entries(tmp_path):
    disk = DiskCache(tmp_path)
    (tmp_path / "calibration-cpu.json").write_text("{}")
    (tmp_path / "notes.json").write_text("{}")
    disk.store(("k",), 1)
    assert [p.name for p in disk.entries()] == [disk._path(("k",)).name]
    assert disk.clear() == 1
    assert (tmp_path / "calibration-cpu.json").exists()


def test_entry_vanishing_between_listing_and_reading(tmp_path):
    disk = DiskCache(tmp_path)
    disk.store(("k",), 1)
    other = DiskCache(tmp_path)
    assert other.clear() == 1
    assert disk.load(("k",)) is None  # vanished: reads as absent, nothing raised
    assert disk.clear() == 0


# -- end to end: compile through a damaged cache ----------------------------------------------

def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(300))


def _zero_length(path: Path) -> None:  # a rename made durable before its data (no fsync)
    path.write_bytes(b"")


@pytest.mark.parametrize("damage", [_truncate, _garbage, _zero_length])
def test_compile_rebuilds_a_damaged_regime_entry(tmp_path, damage, monkeypatch, caplog):
    tncomp.clear_cache()
    net = tncomp.tt_linear([3, 5], [2, 7], 3)
    first = tncomp.compile(net, disk_cache=tmp_path).regimes()
    (entry,) = DiskCache(tmp_path).entries()
    good = entry.read_bytes()
    damage(entry)
    builds = []
    real = tncomp.compiler.planner.build_regimes
    monkeypatch.setattr(tncomp.compiler.planner, "build_regimes",
                        lambda *a, **k: builds.append(1) or real(*a, **k))
    with caplog.at_level(logging.WARNING, logger="tncomp.compiler.cache"):
        f = tncomp.compile(net, disk_cache=tmp_path)
        assert f.regimes() == first
    assert builds == [1]  # recomputed, not loaded
    assert any("rebuilding" in r.getMessage() for r in caplog.records)
    assert entry.read_bytes() == good  # rewritten whole
    ts = operands(net, 6, dtype=torch.float32, requires_grad=True)
    torch.testing.assert_close(f(*ts), reference(net, [t.detach() for t in ts]))
    tncomp.clear_cache()


# -- slow: four tncomp processes compiling one network at once -------------------------------

COMPILE_WORKER = textwrap.dedent("""
    import json, os, sys, time
    import torch
    import tncomp
    from tncomp.compiler.regimes import regimes_to_payload
    torch.set_num_threads(1)
    go = sys.argv[1]
    while not os.path.exists(go):
        time.sleep(0.005)
    net = tncomp.tt_linear([4, 6], [3, 5], 4)
    chain = tncomp.from_eq("ab,bc,cd,de->ae", (3, 4), (4, 5), (5, 6), (6, 2))
    f = tncomp.compile(net)  # the default directory: $TNCOMP_CACHE_DIR
    g = tncomp.compile(chain, optimize="search")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 4, 6, generator=gen, dtype=torch.float64)
    cores = [torch.randn(t, generator=gen, dtype=torch.float64) for t in
             [(1, 4, 4), (4, 6, 4), (4, 3, 4), (4, 5, 1)]]
    y = f(x, *cores)
    ref = torch.einsum("bij,aie,ejf,fkg,glh->bkl", x, *cores)
    assert torch.allclose(y, ref, rtol=1e-10, atol=1e-10)
    mats = [torch.randn(s, generator=gen, dtype=torch.float64)
            for s in [(3, 4), (4, 5), (5, 6), (6, 2)]]
    z = g(*mats)
    assert torch.allclose(z, torch.einsum("ab,bc,cd,de->ae", *mats), rtol=1e-10, atol=1e-10)
    tree = g.plan_for({"a": 3, "b": 4, "c": 5, "d": 6, "e": 2}, (False,) * 4,
                      torch.float64).tree
    print(json.dumps({"regimes": regimes_to_payload(f.regimes()),
                      "chain_tree": [list(s) for s in tree.steps], "y": y.sum().item()}))
""")


@pytest.mark.slow
def test_four_processes_compile_one_network_with_one_cache_dir(tmp_path):
    cache_dir, go = tmp_path / "shared-cache", tmp_path / "go"
    env = {**os.environ, "TNCOMP_CACHE_DIR": str(cache_dir),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [_start(COMPILE_WORKER, go, env=env) for _ in range(N_PROCS)]
    time.sleep(1.0)
    go.touch()
    outputs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert "WARNING" not in err and "Traceback" not in err, err
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    assert all(o == outputs[0] for o in outputs[1:])  # every process agrees
    disk = DiskCache(cache_dir)
    assert len(disk.entries()) >= 2 and disk.temp_files() == []
    for entry in disk.entries():  # every entry on disk is whole and checksummed
        record = json.loads(entry.read_text())
        assert set(record) == {"version", "key", "payload", "checksum"}
    # a fifth process finds everything on disk: it searches nothing
    again = subprocess.run([sys.executable, "-c", COMPILE_WORKER, go], env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1]) == outputs[0]
    assert len(DiskCache(cache_dir).entries()) == len(disk.entries())
