"""The data loaders' tensor cache: encoded data sets saved under the user cache folder.

Every loader caches the same way, through this module:

    path = cache_file("mnli", VERSION, {"source": ..., "max_len": 128})
    blob = read_cached(path)              # None on a miss, or a damaged or foreign file
    ...                                   # build the data, then
    write_cached(path, {"vocab": [...], "train": {"ids": ids, ...}})

A file name is ``<kind>-v<version>-<digest>.pt``, the digest a sha256 of every named parameter
(logged at debug level), so a changed parameter or format version misses. Files are read with
``torch.load(weights_only=True)``: a blob holds only tensors and plain containers (dicts, lists,
strings, numbers), and a pickle planted in the cache folder is refused before any of it runs.
Each file carries a sha256 of its contents (``comera.torchfile.content_digest``): a file
whose contents changed after it was written (flipped labels, a truncated copy), that cannot be
read, that is a link or not a regular file, or that ``decode`` rejects, is logged as corrupt and
rebuilt, never trusted. The checksum detects damage and careless edits, not a writer who
recomputes it: keep the cache folder your own (it is created owner-only, 0700). Files are
read and written by :mod:`comera.torchfile` (atomic writes); temp files
that a killed writer left are swept on a later write. The cache never breaks the loader it serves:
a failed write is logged and the data returned anyway.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from comera.torchfile import (
    content_digest,
    load_error_reason,
    read_torch_file,
    refused_global,
    write_torch_file,
)
from tncomp.files import link_or_special, sweep_temp_files, user_cache_dir

log = logging.getLogger("comera.data")

T = TypeVar("T")
STALE_TEMP_S = 600.0  # a temp file this old belongs to a writer that died mid-write
FORMAT = "comera-data-cache"  # {"format", "sha256", "blob"}: the blob and its checksum


def cache_dir() -> Path:
    """``$COMERA_CACHE_DIR``, else the user cache directory (``~/.cache/comera``)."""
    return user_cache_dir("comera", "COMERA_CACHE_DIR")


def cache_file(kind: str, version: int, key: Mapping[str, Any]) -> Path:
    """The cache file of data set ``kind`` at format ``version`` for the parameters ``key``
    (their ``repr`` is hashed, so give plain values)."""
    digest = hashlib.sha256(repr(sorted(key.items())).encode()).hexdigest()[:20]
    log.debug("data cache key %s v%d: %s -> %s", kind, version, dict(key), digest)
    return cache_dir() / f"{kind}-v{version}-{digest}.pt"


def read_cached(path: Path, decode: Callable[[Any], T] = lambda blob: blob) -> T | None:
    """``decode(blob)`` of the cache file ``path``; None when it is absent, cannot be read
    safely (weights-only), or ``decode`` raises (a warning says it will be rebuilt)."""
    odd = link_or_special(path)
    if odd is not None:
        log.warning("rebuilding data cache %s (it is %s; the cache holds regular files only)",
                    path, odd)
        return None
    if not path.is_file():
        log.debug("data cache miss %s", path)
        return None
    try:
        stored = read_torch_file(path)
        if not isinstance(stored, dict) or stored.get("format") != FORMAT:
            raise ValueError("not a checksummed comera data cache (an older format, or "
                             "another file)")
        if stored.get("sha256") != content_digest(stored.get("blob")):
            raise ValueError("its contents changed after it was written: the checksum does "
                             "not match")
        data = decode(stored["blob"])
    except Exception as exc:  # a corrupt or foreign cache entry is rebuilt, not trusted
        found = refused_global(exc)
        why = (f"it asks to unpickle the Python object {found}, refused unrun" if found
               else load_error_reason(exc))
        log.warning("rebuilding corrupt data cache %s (%s)", path, why)
        return None
    log.debug("data cache hit %s", path)
    return data


def write_cached(path: Path, blob: Mapping[str, Any]) -> None:
    """Save ``blob`` (tensors and plain containers only) and its checksum to ``path``
    atomically (a link planted at ``path`` is replaced, not written through); a failure is
    logged, not raised. A cache folder it creates is owner-only (0700)."""
    blob = dict(blob)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        sweep_temp_files(path.parent, prefix=".", older_than_s=STALE_TEMP_S)
        write_torch_file(path, {"format": FORMAT, "sha256": content_digest(blob), "blob": blob})
    except OSError as exc:
        log.warning("could not write the data cache %s (%s); the data is rebuilt next time",
                    path, exc)
        return
    log.debug("data cache store %s", path)


__all__ = ["cache_dir", "cache_file", "read_cached", "write_cached"]
