"""Files written safely: the one home of atomic writes, temp-file sweeps and cache folders.

Every file the project writes that a crash must not leave half-written (plan-cache entries,
calibrations, checkpoints, data caches) goes through :func:`atomic_write_bytes`: a private temp
file in the same directory, flushed, then renamed over the target. A writer killed mid-write
leaves only its temp file, which :func:`sweep_temp_files` removes on a later start.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from pathlib import Path

log = logging.getLogger("tncomp.files")

TEMP_SUFFIX = ".part"  # every in-progress write ends so: <prefix><pid>-<random>.part
_REPLACE_RETRIES = 5  # os.replace onto a file another process holds open fails on Windows


def user_cache_dir(app: str, env_var: str) -> Path:
    """``$<env_var>``, else ``$XDG_CACHE_HOME/<app>``, else ``~/.cache/<app>``."""
    env = os.environ.get(env_var)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / app


def atomic_write_bytes(path: Path | str, data: bytes, temp_prefix: str | None = None) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file, the new one or none.

    The bytes go to a temp file of this writer's own in the same directory
    (``<temp_prefix><pid>-<random>.part``; default prefix ``.<name>.``), are flushed to disk,
    and the temp file is renamed over ``path`` in one atomic step; the directory is then
    flushed so the rename survives a crash. A failed write removes its temp file and raises the
    ``OSError``. The directory must exist.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"atomic_write_bytes got data of type {type(data).__name__}; pass "
                        "bytes (encode text first, e.g. text.encode()).")
    path = Path(path)
    prefix = f".{path.name}." if temp_prefix is None else temp_prefix
    if "/" in prefix or os.sep in prefix:
        raise ValueError(f"atomic_write_bytes got temp_prefix {prefix!r}; give a bare file-name "
                         "prefix (the temp file goes next to the target).")
    tmp = path.parent / f"{prefix}{os.getpid()}-{secrets.token_hex(8)}{TEMP_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())  # the data is on disk before the name points at it
        _replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def _replace(src: Path, dst: Path) -> None:
    for attempt in range(_REPLACE_RETRIES):
        try:
            os.replace(src, dst)
            return
        except PermissionError:  # Windows: a reader holds dst open; it closes it soon
            if attempt == _REPLACE_RETRIES - 1:
                raise
            time.sleep(0.01 * 2**attempt)


def _fsync_directory(directory: Path) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sweep_temp_files(directory: Path | str, prefix: str = ".",
                     older_than_s: float = 0.0, suffix: str = TEMP_SUFFIX) -> list[Path]:
    """Remove the temp files that interrupted writes left in ``directory`` (names starting
    with ``prefix`` and ending in ``suffix``, ``.part`` by default), if at least
    ``older_than_s`` old; the removed."""
    directory = Path(directory)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    removed, now = [], time.time()
    for name in names:
        if not (name.startswith(prefix) and name.endswith(suffix)):
            continue
        tmp = directory / name
        try:
            age = now - tmp.stat().st_mtime
            if age >= older_than_s:
                tmp.unlink()
                removed.append(tmp)
                log.warning("removed %s, left %.0f s ago by an interrupted write", tmp, age)
        except FileNotFoundError:  # its writer renamed it, or another sweep removed it
            continue
    return removed
