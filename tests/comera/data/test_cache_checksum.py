"""The data cache carries a checksum: a cache whose contents changed after it was written (a
Criteo cache with every label flipped) is detected and rebuilt with a warning; links and
special files planted in the cache are never read; the folder is created owner-only
(issue 26, item 5)."""

from __future__ import annotations

import logging
import os
import stat

import pytest
import torch

from comera.data import cache
from comera.data.criteo import SyntheticCriteo, load_synthetic_criteo

SMALL = (50, 7, 300, 2000)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COMERA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("COMERA_NO_PROGRESS", "1")


def test_a_criteo_cache_with_flipped_labels_is_detected_and_rebuilt(tmp_path, caplog):
    gen = SyntheticCriteo(cardinalities=SMALL)
    data = load_synthetic_criteo(gen, n_train=600, n_val=200, n_test=100)
    (path,) = (tmp_path / "cache").glob("criteo-synthetic-*.pt")
    stored = torch.load(path, weights_only=True)
    for split in ("train", "val", "test"):
        stored["blob"][split]["labels"] = 1 - stored["blob"][split]["labels"]
    torch.save(stored, path)  # a valid torch file, the old checksum
    with caplog.at_level(logging.WARNING, logger="comera.data"):
        again = load_synthetic_criteo(gen, n_train=600, n_val=200, n_test=100)
    assert "the checksum does not match" in caplog.text  # was used without a warning
    assert torch.equal(again.train.labels, data.train.labels)
    assert torch.equal(torch.load(path, weights_only=True)["blob"]["train"]["labels"],
                       data.train.labels)  # rewritten


def test_links_and_fifos_in_the_cache_are_rebuilt_not_read(tmp_path, caplog):
    path = cache.cache_file("thing", 1, {"n": 1})
    path.parent.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere.pt"
    cache.write_cached(elsewhere, {"x": torch.ones(2)})
    path.symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger="comera.data"):
        assert cache.read_cached(path) is None
    assert "symbolic link" in caplog.text
    path.unlink()
    os.mkfifo(path)
    with caplog.at_level(logging.WARNING, logger="comera.data"):
        assert cache.read_cached(path) is None  # a FIFO would hang the read
    assert "not a regular file" in caplog.text


def test_the_cache_folder_is_created_owner_only(tmp_path):
    path = cache.cache_file("thing", 1, {"n": 2})
    cache.write_cached(path, {"x": torch.ones(2)})
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert torch.equal(cache.read_cached(path)["x"], torch.ones(2))
