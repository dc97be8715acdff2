"""The public API around compile: its option checks, the plan cache key's device model, the
calibration file, and what ``import tncomp`` exports and leaves unimported."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import tncomp
import tncomp.runtime.device_timing
from tests.helpers import ROOT
from tncomp import DeviceModel
from tncomp.errors import CacheError, OperandError, OptionError, TncompError
from tncomp.runtime.device_timing import calibration_path, load_calibration, save_calibration

F64 = torch.float64
# Two models at the extremes: only FLOPs cost time, or only bytes moved do.
COMPUTE_BOUND = DeviceModel(1e9, 1e15, 0.0, "compute-bound")
BANDWIDTH_BOUND = DeviceModel(1e15, 1e6, 0.0, "bandwidth-bound")


@pytest.fixture(autouse=True)
def _fresh_plan_cache():
    tncomp.clear_cache()
    yield
    tncomp.clear_cache()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TNCOMP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _chain():
    """A (64, 8) @ B (8, 2) @ C (2, 3): (AB)C takes fewer FLOPs, A(BC) moves fewer bytes."""
    net = tncomp.from_eq("ab,bc,cd->ad", (64, 8), (8, 2), (2, 3))
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=gen, dtype=F64) for s in ((64, 8), (8, 2), (2, 3))]
    return net, tensors


# -- the device model is part of the plan cache key --------------------------------------------

def test_networks_compiled_with_different_models_get_their_own_plans():
    net, ts = _chain()
    want = torch.einsum("ab,bc,cd->ad", *ts)
    # By hand, forward only: (AB)C = 2*64*8*2 + 2*64*2*3 = 2816 FLOPs, A(BC) = 2*8*2*3 +
    # 2*64*8*3 = 3168 FLOPs; but AB holds 128 values and BC only 24.
    fewer_flops, fewer_bytes = (0, 1), (1, 2)
    by_flops = tncomp.compile(net, model=COMPUTE_BOUND, optimize="search", disk_cache=False)
    by_bytes = tncomp.compile(net, model=BANDWIDTH_BOUND, optimize="search", disk_cache=False)
    with torch.no_grad():
        torch.testing.assert_close(by_flops(*ts), want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(by_bytes(*ts), want, rtol=1e-12, atol=1e-12)
        assert by_flops.plan_of(*ts).tree.steps[0] == fewer_flops
        assert by_bytes.plan_of(*ts).tree.steps[0] == fewer_bytes
    info = tncomp.cache_info()
    assert (info["plans"], info["misses"]) == (2, 2)
    # A model equal in every field is the same key: the plan is shared.
    twin = DeviceModel(1e9, 1e15, 0.0, "compute-bound")
    again = tncomp.compile(net, model=twin, optimize="search", disk_cache=False)
    with torch.no_grad():
        assert again.plan_of(*ts).tree.steps[0] == fewer_flops
    info = tncomp.cache_info()
    assert (info["plans"], info["misses"], info["hits"]) == (2, 2, 1)


def test_contract_keys_its_cache_on_the_model():
    _, ts = _chain()
    want = torch.einsum("ab,bc,cd->ad", *ts)
    for model in (COMPUTE_BOUND, BANDWIDTH_BOUND, COMPUTE_BOUND):
        got = tncomp.contract("ab,bc,cd->ad", *ts, model=model, optimize="search",
                              disk_cache=False)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert tncomp.cache_info()["plans"] == 2


def test_contract_options_equal_to_the_defaults_share_an_entry():
    a, b = torch.randn(7, 4, dtype=F64), torch.randn(4, 9, dtype=F64)
    eqs = tncomp.api._EQ_CACHE
    hits, misses = eqs.hits, eqs.misses
    tncomp.contract("ij,jk->ik", a, b, disk_cache=False)
    tncomp.contract("ij,jk->ik", a, b, disk_cache=False, optimize="auto", autotune=False)
    assert (eqs.hits - hits, eqs.misses - misses) == (1, 1)


# -- compile's and contract's options -------------------------------------------------------

@pytest.mark.parametrize("disk_cache", [True, False, None, "dir", Path("dir")])
def test_compile_accepts_bool_none_str_and_path_disk_caches(disk_cache, tmp_path, cache_dir):
    if isinstance(disk_cache, str | Path):
        disk_cache = tmp_path / disk_cache if isinstance(disk_cache, Path) else str(
            tmp_path / disk_cache)
    net = tncomp.from_eq("ij,jk->ik", (3, 4), (4, 5))
    f = tncomp.compile(net, disk_cache=disk_cache, optimize="search")
    a, b = torch.randn(3, 4, dtype=F64), torch.randn(4, 5, dtype=F64)
    torch.testing.assert_close(f(a, b), a @ b, rtol=1e-12, atol=1e-12)
    if disk_cache is True:
        assert f._disk.directory == cache_dir
    elif disk_cache in (False, None):
        assert f._disk is None
    else:
        assert f._disk.directory == Path(disk_cache)
        assert len(f._disk.entries()) == 1  # the searched tree went there


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"disk_cache": 3}, r"disk_cache=3 \(int\); pass True"),
    ({"disk_cache": 1.5}, r"disk_cache=1\.5 \(float\)"),
    ({"disk_cache": b"dir"}, r"disk_cache=b'dir' \(bytes\)"),
    ({"disk_cache": "  "}, r"disk_cache='  ' \(str\)"),
    ({"model": "cpu"}, r"model='cpu' \(str\); pass a tncomp\.DeviceModel"),
    ({"model": torch.device("cpu")}, r"model=device\(type='cpu'\) \(device\)"),
    ({"optimize": None}, r"optimize=None; choose one of auto, search, flops"),
    ({"optimize": ["auto"]}, r"optimize=\['auto'\]"),
])
def test_compile_rejects_bad_options_naming_the_value(kwargs, match):
    net = tncomp.from_eq("ij,jk->ik", (3, 4), (4, 5))
    with pytest.raises(OptionError, match=match) as info:
        tncomp.compile(net, **kwargs)
    assert isinstance(info.value, ValueError)
    with pytest.raises(OptionError, match=match):  # contract checks them the same way
        tncomp.contract("ij,jk->ik", torch.ones(3, 4), torch.ones(4, 5), **kwargs)


def test_contract_rejects_unknown_options_and_non_tensors():
    a, b = torch.ones(3, 4), torch.ones(4, 5)
    with pytest.raises(OptionError, match=r"unknown option 'optimise'.*optimize, autotune"):
        tncomp.contract("ij,jk->ik", a, b, optimise="flops")
    with pytest.raises(OperandError, match=r"contract takes torch tensors; operand 1 is a "
                                           r"tuple\. Convert it with torch\.as_tensor"):
        tncomp.contract("ij,jk->ik", a, ((1.0,) * 5,) * 4)
    with pytest.raises(TypeError):  # OperandError is a TypeError, as the bare error was
        tncomp.contract("ij,jk->ik", None, b)


def test_compiled_network_names_the_non_tensor_operand():
    f = tncomp.compile(tncomp.from_eq("ij,jk->ik", (3, 4), (4, 5)), disk_cache=False)
    with pytest.raises(OperandError, match=r"operand 1 \('T1'\) is None"):
        f(torch.ones(3, 4), None)


# -- the calibration file -----------------------------------------------------------------------

def test_calibration_round_trips_and_leaves_no_temp_file(cache_dir):
    model = DeviceModel(3.5e11, 2.25e10, 7e-6, "calibrated on cpu (torch.float32)")
    path = save_calibration(model, "cpu")
    assert path == cache_dir / "calibration-cpu.json" == calibration_path(torch.device("cpu"))
    assert json.loads(path.read_text()) == {"gemm_flops_per_s": 3.5e11, "bytes_per_s": 2.25e10,
                                            "step_overhead_s": 7e-6, "source": model.source,
                                            "transpose_slowdown": model.transpose_slowdown,
                                            "gather_slowdown": model.gather_slowdown}
    assert load_calibration("cpu") == model
    assert tncomp.api.model_for("cpu") == model  # what compile plans with
    assert load_calibration("cuda") is None  # one file per device type
    assert sorted(p.name for p in cache_dir.iterdir()) == ["calibration-cpu.json"]


def test_a_failed_calibration_write_keeps_the_old_file(cache_dir, monkeypatch):
    old = DeviceModel(1e11, 1e10, 5e-6, "old")
    save_calibration(old, "cpu")

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tncomp.runtime.device_timing.os, "replace", broken_replace)
    with pytest.raises(CacheError, match=r"could not save the calibration to .*calibration-cpu"
                                         r"\.json.*No space left.*TNCOMP_CACHE_DIR") as info:
        save_calibration(DeviceModel(2e11, 2e10, 6e-6, "new"), "cpu")
    assert isinstance(info.value, RuntimeError)
    assert load_calibration("cpu") == old
    assert sorted(p.name for p in cache_dir.iterdir()) == ["calibration-cpu.json"]


def test_an_unwritable_cache_dir_is_a_cache_error(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("TNCOMP_CACHE_DIR", str(blocker / "sub"))
    with pytest.raises(CacheError, match="pass save=False"):
        save_calibration(DeviceModel(), "cpu")


def test_readers_never_see_a_half_written_calibration(cache_dir):
    models = [DeviceModel(1e9 * (k + 1), 1e9, 1e-6, "x" * (4000 * k + 1)) for k in range(3)]
    save_calibration(models[0], "cpu")
    stop = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for k in range(150):
                save_calibration(models[k % 3], "cpu")
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            stop.set()

    writer = threading.Thread(target=write)
    writer.start()
    reads = 0
    while not stop.is_set():
        assert load_calibration("cpu") in models  # never None: never a partial file
        reads += 1
    writer.join()
    assert not errors and reads > 0
    assert [p.name for p in cache_dir.iterdir()] == ["calibration-cpu.json"]


@pytest.mark.parametrize("content", [
    "{", "[]", '{"gemm_flops_per_s": "fast", "bytes_per_s": 1e9, "step_overhead_s": 1e-6}',
    '{"gemm_flops_per_s": 0, "bytes_per_s": 1e9, "step_overhead_s": 1e-6}',
    '{"gemm_flops_per_s": 1e9, "bytes_per_s": 1e9}',
    '{"gemm_flops_per_s": 1e9, "bytes_per_s": 1e9, "step_overhead_s": 1e-6, "extra": 1}',
    '{"gemm_flops_per_s": 1e9, "bytes_per_s": 1e9, "step_overhead_s": 1e-6, '
    '"gather_slowdown": -2}',
    # issue 42, item 5: each raised OverflowError or RecursionError out of compile on main
    '{"gemm_flops_per_s": 1' + "0" * 400 + ', "bytes_per_s": 1e9, "step_overhead_s": 1e-6}',
    '{"gemm_flops_per_s": 1e9, "bytes_per_s": 1e9, "step_overhead_s": 1e-6, '
    '"gemm_dims": [1' + "0" * 400 + '], "gemm_rates": [1e9]}',
    '{"gemm_flops_per_s": 1e400, "bytes_per_s": 1e9, "step_overhead_s": 1e-6}',
    '{"gemm_flops_per_s": NaN, "bytes_per_s": 1e9, "step_overhead_s": 1e-6}',
    '{"gemm_flops_per_s": -Infinity, "bytes_per_s": 1e9, "step_overhead_s": 1e-6}',
    '{"gemm_flops_per_s": 1e9, "bytes_per_s": 1e9, "step_overhead_s": 1e-6, '
    '"source": ' + "[" * 200_000 + "]" * 200_000 + "}",
    "[" * 200_000 + "]" * 200_000,
    '{"gemm_flops_per_s": [1e9], "bytes_per_s": 1e9, "step_overhead_s": 1e-6}',
    '{"gemm_flops_per_s": true, "bytes_per_s": 1e9, "step_overhead_s": 1e-6}',
    '{"gemm_flops_per_s": 1e9, "bytes_per_s": 1e9, "step_overhead_s": 1e-6, "source": 3}',
    '{"gemm_flops_per_s": 1e9, "bytes_per_s": 1e9, "step_overhead_s": 1e-6, '
    '"gemm_dims": ["8"], "gemm_rates": [1e9]}',
    '{"gemm_flops_per_s": 1e9, "bytes_per_s": 1e9, "step_overhead_s": 1e-6, '
    '"gemm_dims": [8], "gemm_rates": {"8": 1e9}}',
    # issue 42, item 7: a table measured on a busy machine (1 MFLOP/s beside 50 GFLOP/s)
    '{"gemm_flops_per_s": 5e10, "bytes_per_s": 1e10, "step_overhead_s": 2e-6, '
    '"gemm_dims": [8, 64], "gemm_rates": [1e6, 1e9, 1e9, 1e9, 1e9, 1e9, 1e9, 1e10]}',
])
def test_a_malformed_calibration_is_ignored_with_a_warning(cache_dir, content, caplog):
    cache_dir.mkdir()
    (cache_dir / "calibration-cpu.json").write_text(content)
    with caplog.at_level(logging.WARNING, logger="tncomp.runtime.device_timing"):
        assert load_calibration("cpu") is None
    assert "ignoring calibration" in caplog.text
    assert tncomp.api.model_for("cpu") == tncomp.compiler.device_model.CPU_DEFAULT
    net, ts = _chain()  # and a compile plans with the default, whatever the file held
    assert torch.equal(tncomp.compile(net, disk_cache=cache_dir)(*ts),
                       tncomp.compile(net, disk_cache=False)(*ts))


def test_a_calibration_with_a_400_digit_rate_stops_no_compile_nor_inspect(cache_dir, capsys):
    """Issue 42, item 5: such a file (468 bytes in the issue) made every compile and ``tncomp
    inspect`` raise a raw OverflowError on main; ``tncomp cache clear`` left it in place."""
    from tncomp.cli import main

    cache_dir.mkdir()
    path = cache_dir / "calibration-cpu.json"
    path.write_text(json.dumps({"gemm_flops_per_s": 10**400, "bytes_per_s": 2.25e10,
                                "step_overhead_s": 7e-6, "source": "planted"}))
    assert len(path.read_bytes()) < 512  # a small file
    net, ts = _chain()
    torch.testing.assert_close(tncomp.compile(net)(*ts), torch.einsum("ab,bc,cd->ad", *ts))
    assert main(["inspect", "eq:ij,jk->ik:2,3|3,4"]) == 0
    assert "default (not calibrated)" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0
    out = capsys.readouterr().out
    assert "removed the calibration files calibration-cpu.json" in out
    assert not path.exists()


def test_cache_clear_removes_every_calibration_and_says_so(cache_dir, capsys):
    from tncomp.cli import main

    save_calibration(DeviceModel(3.5e11, 2.25e10, 7e-6, "cpu"), "cpu")
    save_calibration(DeviceModel(5e13, 2e12, 8e-6, "cuda"), "cuda")
    killed = ".calibration-cpu.json.123-0123456789abcdef.part"  # a write killed midway
    (cache_dir / killed).write_text("{")
    (cache_dir / "calibration-notes.txt").write_text("mine")  # not tncomp's: kept
    tncomp.contract("ij,jk->ik", torch.ones(2, 3), torch.ones(3, 4))
    assert tncomp.cache_info()["calibrations"] == (f"{killed}, calibration-cpu.json, "
                                                   "calibration-cuda.json")
    assert main(["cache", "info"]) == 0
    assert "calibration-cuda.json" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "(1 entry)" in out
    assert "removed the calibration files" in out and "calibration-cuda.json" in out
    assert sorted(p.name for p in cache_dir.iterdir()) == ["calibration-notes.txt"]
    assert tncomp.api.model_for("cpu") == tncomp.compiler.device_model.CPU_DEFAULT
    assert main(["cache", "clear"]) == 0
    assert "no calibration files were there" in capsys.readouterr().out


def test_clear_cache_keeps_the_calibration_unless_asked(cache_dir):
    model = DeviceModel(3.5e11, 2.25e10, 7e-6, "kept")
    save_calibration(model, "cpu")
    tncomp.clear_cache(disk=True)
    assert load_calibration("cpu") == model
    tncomp.clear_cache(calibration=True)
    assert load_calibration("cpu") is None


# -- issue 42, item 6: disk_cache=False reads nothing in the cache folder ------------------------

def test_disk_cache_false_reads_no_calibration(cache_dir, tmp_path, caplog):
    """docs/safety.md offers ``disk_cache=False`` as the defence when others can write the
    cache folder; on main such a compile still planned with the folder's calibration."""
    net, ts = _chain()
    planted = DeviceModel(1e15, 1e6, 1e-9, "planted: only bytes cost time")
    save_calibration(planted, "cpu")
    assert tncomp.compile(net).model("cpu") == planted  # the folder's, by default
    by_planted = tncomp.compile(net, disk_cache=tmp_path / "other", optimize="search")
    assert by_planted.plan_of(*ts).tree == tncomp.compile(
        net, model=BANDWIDTH_BOUND, disk_cache=False, optimize="search").plan_of(*ts).tree
    f = tncomp.compile(net, disk_cache=False, optimize="search")
    assert f.model("cpu") == tncomp.compiler.device_model.CPU_DEFAULT
    assert tncomp.compile(net, disk_cache=None).model("cpu") == f.model("cpu")
    default = tncomp.compile(net, model=tncomp.compiler.device_model.CPU_DEFAULT,
                             disk_cache=False, optimize="search")
    assert f.plan_of(*ts).tree == default.plan_of(*ts).tree
    # nothing is even opened: a file no read survives is not met
    calibration_path("cpu").unlink()
    os.mkfifo(calibration_path("cpu"))
    with caplog.at_level(logging.WARNING):
        tncomp.clear_cache()
        torch.testing.assert_close(tncomp.compile(net, disk_cache=False)(*ts),
                                   torch.einsum("ab,bc,cd->ad", *ts))
        tncomp.contract("ab,bc,cd->ad", *ts, disk_cache=False)
        assert tncomp.inspect(net, disk_cache=False)
    assert caplog.text == ""
    with caplog.at_level(logging.WARNING):  # the default does read the folder
        tncomp.compile(net)(*ts)
    assert "not a regular file" in caplog.text


# -- the package's exports and errors ---------------------------------------------------------

def test_picture_functions_and_errors_are_exported():
    from tncomp import cli, errors
    from tncomp.views import figures

    assert set(tncomp.__all__) >= {"draw_network", "drawing_of", "plot_costs", "cost_curves"}
    assert figures.PlotError is errors.PlotError and issubclass(errors.PlotError, ValueError)
    assert figures.PlotDependencyError is errors.PlotDependencyError
    assert issubclass(errors.PlotDependencyError, ImportError)
    assert cli.OptionError is errors.OptionError and cli.SpecError is errors.SpecError
    for cls in (errors.PlotError, errors.PlotDependencyError, errors.OptionError,
                errors.SpecError, errors.OperandError):
        assert issubclass(cls, TncompError)


def test_import_tncomp_does_not_import_matplotlib():
    code = ("import sys, tncomp; tncomp.drawing_of; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('matplotlib', 'networkx')))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_compiled_network_keys_its_plans_by_device_too():
    """An operand on another device is a new binding: checked again, never a stale runner."""
    import tncomp

    net = tncomp.from_eq("bi,ij->bj", ("B", 4), (4, 3))
    layer = tncomp.compile(net)
    x, w = torch.randn(2, 4), torch.randn(4, 3)
    layer(x, w)
    meta = torch.empty(4, 3, device="meta")
    with pytest.raises(tncomp.errors.SizeError, match="one dtype and device"):
        layer(x, meta)
