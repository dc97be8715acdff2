"""What a writer of the plan-cache folder can do (issue 26, item 3), each reproduction on main:

- a valid-but-bad tree for ``"a,b,c,d,ab,cd->"`` (checksum recomputed) was accepted: at N=200
  the compile failed trying to allocate 12.8 GB (it must be re-scored and rebuilt);
- an entry symlinked to ``/dev/zero`` raised ``MemoryError``; a FIFO hung ``contract`` (entries
  are read only as regular files of bounded size, without following links or blocking);
- the folder was created with the umask's mode (it is created owner-only).
Each result is checked against ``torch.einsum`` in float64, gradients too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import threading

import pytest
import torch

import tncomp
from tests.helpers.tn import operands
from tncomp.compiler.cache import MAX_ENTRY_BYTES, DiskCache, read_bounded
from tncomp.compiler.problem import Tree
from tncomp.errors import CacheError

EQ = "a,b,c,d,ab,cd->"
N = 200
# The planted tree: a (x) b, c (x) d, then (ab) (x) (cd), an intermediate of N^4 elements.
BAD = Tree(6, ((0, 1), (2, 3), (6, 7), (8, 4), (9, 5)))


@pytest.fixture(autouse=True)
def _fresh_plan_cache():
    tncomp.clear_cache()
    yield
    tncomp.clear_cache()


def _operands(requires_grad: bool = True) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(N,), (N,), (N,), (N,), (N, N), (N, N)]
    return [torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=requires_grad)
            for s in shapes]


def _check(out: torch.Tensor, tensors: list[torch.Tensor], eq: str = EQ) -> None:
    ref = torch.einsum(eq, *tensors)
    torch.testing.assert_close(out, ref)
    probe = torch.randn_like(ref)
    got = torch.autograd.grad(out, tensors, probe)
    want = torch.autograd.grad(ref, tensors, probe)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def _the_entry(directory) -> os.PathLike:
    (path,) = directory.glob("*.json")
    return path


def _plant(path, payload) -> None:
    """Rewrite an entry as anyone who can write the folder can: checksum recomputed."""
    record = json.loads(path.read_text())
    record["payload"] = payload
    record["checksum"] = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    path.write_text(json.dumps(record))


def test_a_planted_valid_but_bad_tree_is_rescored_and_rebuilt(tmp_path, caplog):
    tensors = _operands()
    _check(tncomp.contract(EQ, *tensors, disk_cache=tmp_path), tensors)
    entry = _the_entry(tmp_path)
    _plant(entry, BAD.to_payload())
    tncomp.clear_cache()  # memory only: the next compile reads the planted entry
    with caplog.at_level(logging.WARNING, logger="tncomp.compiler.cache"):
        out = tncomp.contract(EQ, *tensors, disk_cache=tmp_path)
    _check(out, tensors)
    assert "far worse than greedy" in caplog.text
    stored = Tree.from_payload(json.loads(entry.read_text())["payload"])
    assert stored != BAD, "the rebuilt tree replaced the planted one"


def test_a_planted_bad_regime_table_is_rebuilt(tmp_path, caplog):
    net = tncomp.from_eq("za,zb,c,d,ab,cd->z", ("B", N), ("B", N), (N,), (N,), (N, N), (N, N))
    compiled = tncomp.compile(net, disk_cache=tmp_path)
    good = compiled.regimes(itemsize=8)
    entry = _the_entry(tmp_path)
    record = json.loads(entry.read_text())
    _plant(entry, {"regimes": [{"lo": good.regimes[0].lo, "hi": good.regimes[-1].hi,
                                "tree": BAD.to_payload()}]})
    assert json.loads(entry.read_text())["payload"] != record["payload"]
    with caplog.at_level(logging.WARNING, logger="tncomp.compiler.cache"):
        table = tncomp.compile(net, disk_cache=tmp_path).regimes(itemsize=8)
    assert "far worse than greedy" in caplog.text
    assert all(r.tree != BAD for r in table.regimes)
    tensors = operands(net, 3, requires_grad=True)
    eq = "za,zb,c,d,ab,cd->z"
    _check(tncomp.compile(net, disk_cache=tmp_path)(*tensors), tensors, eq)


def test_the_search_own_trees_pass_the_check(tmp_path, caplog):
    tensors = _operands()
    tncomp.contract(EQ, *tensors, disk_cache=tmp_path)
    tncomp.clear_cache()
    with caplog.at_level(logging.WARNING, logger="tncomp.compiler.cache"):
        _check(tncomp.contract(EQ, *tensors, disk_cache=tmp_path), tensors)
    assert caplog.text == ""


def test_an_entry_linked_to_dev_zero_is_refused_without_reading_it(tmp_path, caplog):
    tensors = _operands()
    tncomp.contract(EQ, *tensors, disk_cache=tmp_path)
    entry = _the_entry(tmp_path)
    entry.unlink()
    entry.symlink_to("/dev/zero")
    tncomp.clear_cache()
    with caplog.at_level(logging.WARNING, logger="tncomp.compiler.cache"):
        _check(tncomp.contract(EQ, *tensors, disk_cache=tmp_path), tensors)
    assert "symbolic link" in caplog.text
    assert not entry.is_symlink() and entry.is_file(), "the rebuilt entry replaced the link"


def test_an_entry_linked_to_a_good_entry_elsewhere_is_refused(tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with pytest.raises(CacheError, match="symbolic link"):
        read_bounded(link)
    assert read_bounded(target) == b"{}"


def test_an_entry_replaced_by_a_fifo_does_not_hang(tmp_path, caplog):
    tensors = _operands()
    tncomp.contract(EQ, *tensors, disk_cache=tmp_path)
    entry = _the_entry(tmp_path)
    entry.unlink()
    os.mkfifo(entry)
    tncomp.clear_cache()
    result: list = []

    def run():
        result.append(tncomp.contract(EQ, *tensors, disk_cache=tmp_path))

    worker = threading.Thread(target=run, daemon=True)
    with caplog.at_level(logging.WARNING, logger="tncomp.compiler.cache"):
        worker.start()
        worker.join(timeout=60)
    assert not worker.is_alive(), "contract hung on a FIFO in the cache folder"
    _check(result[0], tensors)
    assert "not a regular file" in caplog.text


def test_an_oversized_entry_is_refused_unread(tmp_path, caplog):
    disk = DiskCache(tmp_path)
    disk.store(("k",), {"v": 1})
    entry = _the_entry(tmp_path)
    with entry.open("ab") as fh:
        fh.truncate(MAX_ENTRY_BYTES + 1)  # sparse: no disk used
    with caplog.at_level(logging.WARNING, logger="tncomp.compiler.cache"):
        assert disk.load(("k",)) is None
    assert f"at most {MAX_ENTRY_BYTES}" in caplog.text


def test_a_created_cache_folder_is_owner_only(tmp_path):
    folder = tmp_path / "made" / "by" / "tncomp"
    DiskCache(folder).store(("k",), {"v": 1})
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert DiskCache(folder).load(("k",)) == {"v": 1}


def test_an_existing_cache_folder_keeps_its_mode(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    DiskCache(folder).store(("k",), {"v": 1})
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755


def test_a_calibration_linked_elsewhere_is_ignored(tmp_path, monkeypatch, caplog):
    from tncomp.runtime.device_timing import calibration_path, load_calibration

    monkeypatch.setenv("TNCOMP_CACHE_DIR", str(tmp_path))
    path = calibration_path("cpu")
    path.symlink_to("/dev/zero")
    with caplog.at_level(logging.WARNING):
        assert load_calibration("cpu") is None
    assert "symbolic link" in caplog.text


# -- issue 42, item 5: entries that are not plain JSON data are logged and rebuilt ----------------
# On main a planted entry nested 200,000 deep (400 KB, under the size cap) raised RecursionError
# out of contract; the same for a calibration (tests/tncomp/test_api.py).

DEEP = "[" * 200_000 + "]" * 200_000


@pytest.mark.parametrize("content", [
    pytest.param(DEEP, id="nested-200000-deep"),
    pytest.param('{"version": 2, "payload": ' + DEEP + "}", id="payload-nested-200000-deep"),
    pytest.param('{"version": 2, "payload": {"n": 1' + "0" * 400 + "}}", id="400-digit-int"),
    pytest.param('{"version": 2, "payload": {"n": NaN}}', id="nan"),
    pytest.param('{"version": 2, "payload": {"n": 1e400}}', id="float-overflow"),
])
def test_an_entry_that_is_not_plain_json_data_is_logged_and_rebuilt(tmp_path, caplog, content):
    tensors = _operands()
    tncomp.contract(EQ, *tensors, disk_cache=tmp_path)
    entry = _the_entry(tmp_path)
    entry.write_text(content)
    assert entry.stat().st_size <= MAX_ENTRY_BYTES  # read, not refused for its size
    tncomp.clear_cache()
    with caplog.at_level(logging.WARNING, logger="tncomp.compiler.cache"):
        _check(tncomp.contract(EQ, *tensors, disk_cache=tmp_path), tensors)
    assert "unreadable entry" in caplog.text
    assert Tree.from_payload(json.loads(entry.read_text())["payload"], 6), "rebuilt"


def test_an_entry_with_a_checksum_over_a_huge_int_is_refused_before_any_float(tmp_path, caplog):
    disk = DiskCache(tmp_path)
    disk.store(("k",), {"n": 1})
    _plant(_the_entry(tmp_path), {"n": 10**400})  # a valid checksum over the planted payload
    with caplog.at_level(logging.WARNING, logger="tncomp.compiler.cache"):
        assert disk.load(("k",), parse=lambda p: float(p["n"])) is None
    assert "an int of 401 digits" in caplog.text


def test_a_parser_that_misses_a_wrong_type_still_reads_the_entry_as_absent(tmp_path, caplog):
    disk = DiskCache(tmp_path)
    disk.store(("k",), {"n": "three"})
    with caplog.at_level(logging.WARNING, logger="tncomp.compiler.cache"):
        assert disk.load(("k",), parse=lambda p: p["n"] + 1) is None
    assert "malformed entry" in caplog.text and "TypeError" in caplog.text


def test_read_json_keeps_plain_data_and_names_every_fault(tmp_path):
    from tncomp.compiler.cache import MAX_JSON_DEPTH, parse_json, read_json

    path = tmp_path / "ok.json"
    value = {"a": [1, -2.5, "x", None, True, 2**63 - 1], "b": [[[[]]]]}
    path.write_text(json.dumps(value))
    assert read_json(path) == value
    nested = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert parse_json(nested, "here") is not None  # at the bound: read
    for text, fault in [("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), "nests"),
                        ("{" + '"a":{' * 2000 + "}" * 2001, "nests"),
                        ("-1" + "0" * 30, "an int of 31 digits"),
                        ("[Infinity]", "Infinity is not a number"),
                        ("[-1e999]", "too large for a float"),
                        ("{", "not valid JSON"), (b"\xff\xfe\x00", "not valid JSON")]:
        with pytest.raises(CacheError, match=fault):
            parse_json(text, "here")
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "absent.json")


def test_clear_removes_what_it_can_and_logs_the_rest(tmp_path, caplog):
    disk = DiskCache(tmp_path)
    disk.store(("k",), 1)
    planted = tmp_path / ("0" * 32 + ".json")
    planted.mkdir()  # a folder at an entry's name
    with caplog.at_level(logging.WARNING, logger="tncomp.compiler.cache"):
        assert disk.clear() == 1
    assert "could not remove" in caplog.text and planted.is_dir()
