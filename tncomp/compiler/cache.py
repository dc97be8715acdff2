"""Plan caches: a bounded in-memory LRU, and an on-disk store of search results.

Keys are built from named parts (structure, sizes, dtype, device, gradients, options, format
version) and logged at debug level (``TNCOMP_DEBUG=1``). Disk entries are JSON records with a
checksum, one file per key. Several processes may share one cache directory: each write goes to
a temp file of its own (pid + random name), is flushed to disk and renamed over the entry in one
atomic step, so a reader sees the old entry, the new one or none, never half a file. Whatever a
crash leaves behind (a stale temp file, a truncated or garbage entry) is detected, logged and
rebuilt rather than trusted.

The folder is trusted no further than its checksums go, which is not far: anyone who can write
it can write a valid entry. So an entry is read only when it is a regular file of at most
:data:`MAX_ENTRY_BYTES`, opened without following a symbolic link and without blocking (a link
to ``/dev/zero`` or a FIFO reads as a bad entry, neither allocating nor hanging), and the
planner re-scores a loaded tree against a fresh greedy one and rebuilds it when it is far worse
(:func:`~tncomp.compiler.search.implausible`). The folder is created owner-only (0700).

Every file is read as plain JSON data (:func:`read_json`): no NaN or infinity, no int of more
than :data:`MAX_JSON_INT_DIGITS` digits, nesting at most :data:`MAX_JSON_DEPTH` deep. A file
that breaks one of these rules (a 400-digit rate, an array nested 200,000 deep) is a
:class:`~tncomp.errors.CacheError`, which the readers log and ignore, never an ``OverflowError``
or a ``RecursionError`` out of a compile.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import re
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

from tncomp.errors import CacheError
from tncomp.files import atomic_write_bytes, user_cache_dir

__all__ = ["FORMAT_VERSION", "MAX_ENTRY_BYTES", "MAX_JSON_DEPTH", "MAX_JSON_INT_DIGITS",
           "STALE_TEMP_S", "TEMP_PREFIX", "DiskCache", "LRUCache", "default_cache_dir",
           "key_digest", "make_private_dir", "parse_json", "read_bounded", "read_json"]

log = logging.getLogger("tncomp.compiler.cache")

FORMAT_VERSION = 2  # 2: trees as Tree.to_payload, regimes as {lo, hi, tree}, canonical sizes
TEMP_PREFIX = ".tmp-"  # in-progress writes: .tmp-<pid>-<random>.part (never read as entries)
STALE_TEMP_S = 600.0  # a temp file this old belongs to a writer that died mid-write
_ENTRY_NAME = re.compile(r"^[0-9a-f]{32}\.json$")
MAX_ENTRY_BYTES = 1 << 20  # a regime table of 64 operands is a few tens of KB
MAX_JSON_DEPTH = 32  # a regime table nests 5 deep, an autotuned entry 4, a calibration 2
MAX_JSON_INT_DIGITS = 20  # every 64-bit int has at most 20 digits; a float holds it


_MISSING = object()


class LRUCache:
    """A bounded mapping that evicts the least recently used entry; counts hits and misses.

    Safe to share between threads: lookups, inserts and evictions hold a lock; ``build`` runs
    outside it, so two threads missing one key at once may both build (wasted work, one wins)."""

    def __init__(self, maxsize: int = 256):
        if maxsize < 1:
            raise ValueError(f"maxsize={maxsize}; an LRU cache holds at least one entry.")
        self.maxsize = maxsize
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get_or_build(self, key: Hashable, build: Callable[[], Any], label: str = "") -> Any:
        with self._lock:
            value = self._data.get(key, _MISSING)
            if value is not _MISSING:
                self.hits += 1
                self._data.move_to_end(key)
        if value is not _MISSING:
            log.debug("plan cache hit %s", label)
            return value
        log.debug("plan cache miss %s key=%s", label, key)
        value = build()
        with self._lock:
            self.misses += 1
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.hits = self.misses = 0


def default_cache_dir() -> Path:
    """tncomp's cache: ``$TNCOMP_CACHE_DIR``, else the user cache directory."""
    return user_cache_dir("tncomp", "TNCOMP_CACHE_DIR")


def read_bounded(path: Path | str, max_bytes: int = MAX_ENTRY_BYTES) -> bytes:
    """The bytes of the regular file at ``path``, read in one open without following a symbolic
    link at ``path`` and without blocking (``O_NOFOLLOW | O_NONBLOCK``).

    ``FileNotFoundError`` when it is absent; :class:`CacheError` (naming the path and what it
    is) when it is a link, not a regular file (a FIFO, a device, a directory) or larger than
    ``max_bytes``, so a planted ``/dev/zero`` allocates nothing and a FIFO cannot hang a read.
    """
    flags = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
             | getattr(os, "O_CLOEXEC", 0))
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW on a link (Linux, BSD)
            raise CacheError(f"{path} is a symbolic link; cache files are read only when they "
                             "are regular files.") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CacheError(f"{path} is not a regular file (mode {stat.filemode(info.st_mode)}); "
                             "cache files are read only when they are regular files.")
        if info.st_size > max_bytes:
            raise CacheError(f"{path} holds {info.st_size} bytes; a cache file holds at most "
                             f"{max_bytes}.")
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:  # it grew while being read
            raise CacheError(f"{path} holds more than {max_bytes} bytes; a cache file holds at "
                             f"most {max_bytes}.")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_json(path: Path | str, max_bytes: int = MAX_ENTRY_BYTES) -> Any:
    """The JSON value of the regular file at ``path``, read as :func:`read_bounded` reads and
    parsed as :func:`parse_json` parses.

    ``FileNotFoundError`` when it is absent, another ``OSError`` when it cannot be opened, and a
    :class:`CacheError` naming the path and the fault for anything else."""
    return parse_json(read_bounded(path, max_bytes), str(path))


def parse_json(data: bytes | str, where: str) -> Any:
    """``data`` parsed as JSON that holds plain data only: finite floats, ints of at most
    :data:`MAX_JSON_INT_DIGITS` digits, nesting at most :data:`MAX_JSON_DEPTH` deep.

    Anything else (invalid JSON, NaN, a 400-digit int, an array nested 200,000 deep) is a
    :class:`CacheError` naming ``where`` and the fault, so a planted file can neither overflow
    a float conversion nor exhaust the interpreter's stack."""
    try:
        value = json.loads(data, parse_int=_bounded_int, parse_float=_finite_float,
                           parse_constant=_no_constant)
    except RecursionError:
        raise CacheError(f"{where} nests its JSON deeper than Python can parse; tncomp's files "
                         f"nest at most {MAX_JSON_DEPTH} deep.") from None
    except ValueError as exc:  # invalid JSON, not UTF-8, or refused by the hooks below
        raise CacheError(f"{where} is not valid JSON data ({exc}).") from None
    depth = _depth(value)
    if depth > MAX_JSON_DEPTH:
        raise CacheError(f"{where} nests its JSON {depth} deep; tncomp's files nest at most "
                         f"{MAX_JSON_DEPTH} deep.")
    return value


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_JSON_INT_DIGITS:
        raise ValueError(f"an int of {digits} digits; tncomp writes ints of at most "
                         f"{MAX_JSON_INT_DIGITS}")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is too large for a float")
    return value


def _no_constant(text: str) -> float:
    raise ValueError(f"{text} is not a number tncomp writes")


def _depth(value: Any) -> int:
    """How deep lists and dicts nest in ``value`` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, level)
            if level <= MAX_JSON_DEPTH:  # deeper is refused anyway: stop looking
                stack.extend((child, level + 1) for child in item)
    return deepest


def make_private_dir(directory: Path) -> None:
    """Create ``directory`` (and missing parents) if absent; the folder itself owner-only
    (0700). An existing folder keeps its mode: whoever made it chose it."""
    if not directory.is_dir():
        try:
            directory.mkdir(mode=0o700, parents=True)
        except FileExistsError:  # made meanwhile by another process, or a file is in the way
            if not directory.is_dir():
                raise


def key_digest(key: Hashable) -> str:
    return hashlib.sha256(repr((FORMAT_VERSION, key)).encode()).hexdigest()[:32]


class DiskCache:
    """Search results as checksummed JSON files, one per key, in ``directory``.

    Safe to share between processes: writes are atomic renames of private temp files, reads
    verify version, key and checksum, and an entry or temp file that vanishes under a reader
    (a concurrent ``clear``) reads as absent.
    """

    def __init__(self, directory: Path | str | None = None, stale_temp_s: float = STALE_TEMP_S):
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.stale_temp_s = stale_temp_s

    def _path(self, key: Hashable) -> Path:
        return self.directory / f"{key_digest(key)}.json"

    def load(self, key: Hashable, parse: Callable[[Any], Any] | None = None) -> Any | None:
        """The stored payload, or None when absent, corrupt or written for another key.

        ``parse`` (e.g. :meth:`~tncomp.compiler.problem.Tree.from_payload`) turns the payload
        into its value; a checksum-valid entry that it refuses with a :class:`CacheError`
        (malformed: a tree over the wrong leaves, a str where an int belongs) is logged and
        read as absent, so the caller rebuilds it."""
        path = self._path(key)
        try:
            data = read_bounded(path)  # one open: a concurrent rename cannot mix two versions
        except FileNotFoundError:
            return None
        except (OSError, CacheError) as exc:
            log.warning("tncomp disk cache: cannot read %s (%s); rebuilding it", path, exc)
            return None
        try:
            record = parse_json(data, str(path))
        except CacheError as exc:  # truncated, garbage, not UTF-8, huge ints, deep nesting
            log.warning("tncomp disk cache: unreadable entry %s (%s); rebuilding it", path, exc)
            return None
        if not (isinstance(record, dict) and "payload" in record):
            log.warning("tncomp disk cache: %s is not a cache record; rebuilding it", path)
            return None
        payload = record["payload"]
        if record.get("version") != FORMAT_VERSION or record.get("key") != repr(key):
            log.warning("tncomp disk cache: stale entry %s (another version or key); "
                        "rebuilding it", path)
            return None
        if record.get("checksum") != _checksum(payload):
            log.warning("tncomp disk cache: corrupt entry %s (checksum mismatch); rebuilding it",
                        path)
            return None
        if parse is not None:
            try:
                payload = parse(payload)
            except CacheError as exc:
                log.warning("tncomp disk cache: malformed entry %s (%s); rebuilding it", path, exc)
                return None
            except (LookupError, TypeError, ValueError, ArithmeticError) as exc:
                # a parser that missed a wrong type: still a malformed entry, never a crash
                log.warning("tncomp disk cache: malformed entry %s (%s: %s); rebuilding it",
                            path, type(exc).__name__, exc)
                return None
        log.debug("disk cache hit %s", path.name)
        return payload

    def store(self, key: Hashable, payload: Any) -> None:
        """Write atomically: a crash mid-write leaves the old entry or none, never half a file.

        An unwritable directory (read-only, full, or not a directory) is logged, not raised:
        the cache must never break the computation it serves.
        """
        record = {"version": FORMAT_VERSION, "key": repr(key), "payload": payload,
                  "checksum": _checksum(payload)}
        data = json.dumps(record).encode()
        path = self._path(key)
        try:
            make_private_dir(self.directory)
            self._sweep_temps(self.stale_temp_s)
            atomic_write_bytes(path, data, temp_prefix=TEMP_PREFIX)
        except FileNotFoundError as exc:  # a concurrent clear() swept our temp file away
            log.debug("tncomp disk cache: %s not written (%s); a clear ran meanwhile", path, exc)
            return
        except OSError as exc:
            log.warning("tncomp disk cache: could not write %s (%s)", path, exc)
            return
        log.debug("disk cache store %s", path.name)

    def entries(self) -> list[Path]:
        """The entry files (temp files and other files in the directory are not entries)."""
        try:
            names = os.listdir(self.directory)
        except OSError:  # absent, or not a directory
            return []
        return sorted(self.directory / n for n in names if _ENTRY_NAME.match(n))

    def temp_files(self) -> list[Path]:
        """Temp files of writes in progress, or left behind by writers that died."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        return sorted(self.directory / n for n in names if n.startswith(TEMP_PREFIX))

    def clear(self) -> int:
        """Remove every entry and temp file; return how many entries were removed."""
        removed = 0
        for path in self.entries():
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:  # removed by a concurrent clear
                pass
            except OSError as exc:  # a directory planted at an entry's name, say
                log.warning("tncomp disk cache: could not remove %s (%s)", path, exc)
        self._sweep_temps(0.0)
        return removed

    def _sweep_temps(self, older_than_s: float) -> None:
        now = time.time()
        for tmp in self.temp_files():
            try:
                age = now - tmp.stat().st_mtime
                if older_than_s <= 0 or age >= older_than_s:
                    tmp.unlink()
                    if older_than_s > 0:
                        log.warning("tncomp disk cache: removed %s, left %.0f s ago by an "
                                    "interrupted write", tmp, age)
            except FileNotFoundError:  # its writer renamed it, or another sweep removed it
                continue


def _checksum(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
