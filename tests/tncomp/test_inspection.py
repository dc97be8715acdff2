"""``tncomp.inspect(..., measure=True)`` and ``tncomp inspect --measure`` (issue 42, items 7 and 8):
the memory limit is checked before the operands are allocated, the threads are chosen, and a
measurement far slower than modelled is measured again and said to be doubtful."""

from __future__ import annotations

import re

import pytest
import torch

import tncomp
from tncomp.cli import main
from tncomp.compiler.device_model import DeviceModel
from tncomp.compiler.memory import MEMORY_LIMIT_ENV
from tncomp.errors import MemoryLimitError, OptionError
from tncomp.runtime.device_timing import save_calibration
from tncomp.runtime.profile import MeasurementWarning

N = 1000
SPEC = f"eq:bi,ij->bj:B,{N}|{N},{N}"
# planning holds dW, dx and y (4.0 MB at B=1); measuring also holds W, x and dY (8.0 MB)
LIMIT = 6_000_000
IMPOSSIBLY_FAST = DeviceModel(1e18, 1e18, 1e-12, "impossibly fast")


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("TNCOMP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(MEMORY_LIMIT_ENV, raising=False)
    tncomp.clear_cache()
    yield
    tncomp.clear_cache()


def _net() -> tncomp.Network:
    return tncomp.from_eq("bi,ij->bj", ("B", N), (N, N))


def test_measuring_over_the_memory_limit_is_refused_before_any_operand_exists(monkeypatch):
    """On main the measurement allocated whatever the sizes asked (6.4 GB for a declared
    40000x40000 network at --batch 1) without the check compile makes."""
    net = _net()
    assert tncomp.inspect(net, batch=1, memory_limit=LIMIT)  # the plan itself fits
    made = []
    monkeypatch.setattr(torch, "randn", lambda *a, **k: made.append(a))
    with pytest.raises(MemoryLimitError, match=r"measuring this plan \(operands \(1, 1000\), "
                                               r"\(1000, 1000\)\) would hold 7\.64 MiB.*limit is "
                                               r"5\.72 MiB.*memory_limit=BYTES"):
        tncomp.inspect(net, batch=1, measure=True, memory_limit=LIMIT)
    assert made == []


def test_the_cli_refuses_it_in_one_line_under_the_environments_limit(monkeypatch, capsys):
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(LIMIT))
    assert main(["inspect", SPEC, "--batch", "1", "--measure"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith("tncomp: error: measuring this plan") and MEMORY_LIMIT_ENV in err
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(4 * LIMIT))
    assert main(["inspect", SPEC, "--batch", "1", "--measure", "--threads", "1"]) == 0
    assert "measured" in capsys.readouterr().out


def test_measure_runs_at_the_threads_asked_and_restores_the_count():
    before = torch.get_num_threads()
    text = tncomp.inspect(tncomp.tt_linear([4, 8], [8, 4], 4), batch=32, measure=True,
                          threads=1)
    assert re.search(r"median of 7 runs, 1 threads;", text)
    assert torch.get_num_threads() == before
    with pytest.raises(OptionError, match=r"threads=1 sets the threads a measurement runs on; "
                                          r"pass measure=True"):
        tncomp.inspect(_net(), batch=1, threads=1)
    with pytest.raises(OptionError, match=r"threads=0; give a number of threads from 1"):
        tncomp.inspect(_net(), batch=1, measure=True, threads=0)


def test_a_measurement_far_slower_than_modelled_is_repeated_and_doubted():
    net = tncomp.tt_linear([4, 8], [8, 4], 4)
    with pytest.warns(MeasurementWarning, match=r"ran \d+x its modelled time .* in both of two "
                                                r"measurements at 1 threads: other work held "
                                                r"the cores, or the device model \(impossibly "
                                                r"fast\) is far from this machine"):
        text = tncomp.inspect(net, batch=32, measure=True, threads=1, model=IMPOSSIBLY_FAST)
    assert "measured" in text  # the report still shows what was measured


def test_the_cli_says_so_in_one_warning_line(capsys):
    save_calibration(IMPOSSIBLY_FAST, "cpu")
    assert main(["inspect", "tt:32x32:modes=4,8|8,4:rank=4", "--batch", "32", "--measure",
                 "--threads", "1"]) == 0
    out, err = capsys.readouterr()
    assert "measured" in out
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tncomp: warning: the plan ran"), err
    assert "recalibrate (tncomp calibrate)" in lines[0]


def test_a_plausible_measurement_is_measured_once_and_not_doubted(recwarn):
    net = tncomp.tt_linear([4, 8], [8, 4], 4)
    slow = DeviceModel(1e6, 1e6, 1.0, "far slower than any machine")
    tncomp.inspect(net, batch=32, measure=True, threads=1, model=slow)
    assert not [w for w in recwarn if issubclass(w.category, MeasurementWarning)]
