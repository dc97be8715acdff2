"""Plan caches: a bounded in-memory LRU, and an on-disk store of search results.

Keys are built from named parts (structure, sizes, dtype, device, gradients, options, format
version) and logged at debug level (``TNCOMP_DEBUG=1``). Disk entries are JSON written
atomically (temp file + rename) with a checksum; a corrupt or mismatched entry is detected,
logged, and rebuilt rather than trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

log = logging.getLogger("tncomp.cache")

FORMAT_VERSION = 1


class LRUCache:
    """A bounded mapping that evicts the least recently used entry; counts hits and misses."""

    def __init__(self, maxsize: int = 256):
        if maxsize < 1:
            raise ValueError(f"maxsize={maxsize}; an LRU cache holds at least one entry.")
        self.maxsize = maxsize
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get_or_build(self, key: Hashable, build: Callable[[], Any], label: str = "") -> Any:
        try:
            value = self._data[key]
        except KeyError:
            self.misses += 1
            log.debug("plan cache miss %s key=%s", label, key)
            value = build()
            self._data[key] = value
            if len(self._data) > self.maxsize:
                self._data.popitem(last=False)
            return value
        self.hits += 1
        self._data.move_to_end(key)
        log.debug("plan cache hit %s", label)
        return value

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def clear(self) -> None:
        self._data.clear()
        self.hits = self.misses = 0


def user_cache_dir(app: str, env_var: str) -> Path:
    """``$<env_var>``, else ``$XDG_CACHE_HOME/<app>``, else ``~/.cache/<app>``."""
    env = os.environ.get(env_var)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / app


def default_cache_dir() -> Path:
    """tncomp's cache: ``$TNCOMP_CACHE_DIR``, else the user cache directory."""
    return user_cache_dir("tncomp", "TNCOMP_CACHE_DIR")


def key_digest(key: Hashable) -> str:
    return hashlib.sha256(repr((FORMAT_VERSION, key)).encode()).hexdigest()[:32]


class DiskCache:
    """Search results as checksummed JSON files, one per key, in ``directory``."""

    def __init__(self, directory: Path | str | None = None):
        self.directory = Path(directory) if directory is not None else default_cache_dir()

    def _path(self, key: Hashable) -> Path:
        return self.directory / f"{key_digest(key)}.json"

    def load(self, key: Hashable) -> Any | None:
        """The stored payload, or None when absent, corrupt or written for another key."""
        path = self._path(key)
        try:
            record = json.loads(path.read_text())
            payload = record["payload"]
            ok = (record.get("version") == FORMAT_VERSION
                  and record.get("key") == repr(key)
                  and record.get("checksum") == _checksum(payload))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("tncomp disk cache: unreadable entry %s (%s); rebuilding it", path, exc)
            return None
        if not ok:
            log.warning("tncomp disk cache: corrupt or stale entry %s; rebuilding it", path)
            return None
        log.debug("disk cache hit %s", path.name)
        return payload

    def store(self, key: Hashable, payload: Any) -> None:
        """Write atomically: a crash mid-write leaves the old entry or none, never half a file."""
        record = {"version": FORMAT_VERSION, "key": repr(key), "payload": payload,
                  "checksum": _checksum(payload)}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "w") as fh:
                json.dump(record, fh)
            os.replace(tmp, self._path(key))
        except OSError as exc:  # a read-only or full disk must not break training
            log.warning("tncomp disk cache: could not write to %s (%s)", self.directory, exc)

    def entries(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return sorted(self.directory.glob("*.json"))

    def clear(self) -> int:
        removed = 0
        for path in self.entries():
            path.unlink(missing_ok=True)
            removed += 1
        return removed


def _checksum(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
