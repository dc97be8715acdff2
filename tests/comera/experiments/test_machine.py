"""The one machine fingerprint that experiment summaries and benchmark results record."""

from __future__ import annotations

import re

import torch

from comera.experiments.results import machine
from tests.helpers import ROOT


def test_machine_records_versions_cpu_threads_device_and_commit():
    m = machine()
    assert m["torch"] == torch.__version__
    assert m["threads"] == torch.get_num_threads() and m["cores"] >= 1
    assert m["device"] == "cpu" and m["device_name"] == m["cpu"] and m["cpu"]
    if (ROOT / ".git").exists():  # a checkout (a source tarball has no commit to record)
        assert re.fullmatch(r"[0-9a-f]{4,40}", m["commit"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", m["date"])
    assert m["workers"] == 1
