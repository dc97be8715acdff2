"""Shared setup of the tncomp test suite.

Every test session gets its own tncomp disk-cache directory (``TNCOMP_CACHE_DIR``), so no test
reads a calibration or a search result left in the user's real cache, or writes into it.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _isolated_tncomp_cache_dir(tmp_path_factory):
    previous = os.environ.get("TNCOMP_CACHE_DIR")
    os.environ["TNCOMP_CACHE_DIR"] = str(tmp_path_factory.mktemp("tncomp-cache"))
    yield
    if previous is None:
        os.environ.pop("TNCOMP_CACHE_DIR", None)
    else:
        os.environ["TNCOMP_CACHE_DIR"] = previous


@pytest.fixture(scope="module")
def one_thread():
    """Small tensors: one torch thread is faster, and several threads per test process
    oversubscribe a shared 2-core CPU. Restored after the module."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
