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
import stat
import time
from pathlib import Path

__all__ = ["O_NOFOLLOW", "TEMP_SUFFIX", "atomic_write_bytes", "atomic_write_text",
           "link_or_special", "sweep_temp_files", "user_cache_dir"]

log = logging.getLogger("tncomp.files")

TEMP_SUFFIX = ".part"  # every in-progress write ends so: <prefix><pid>-<random>.part
# open() flag that refuses a symbolic link as the last path component (0 where there is none)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
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

    No symbolic link is followed: the temp file is created fresh (``O_EXCL | O_NOFOLLOW``) and
    the rename replaces a link planted at ``path`` rather than writing into what it points at.
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
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW, 0o644)
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


def atomic_write_text(path: Path | str, text: str, temp_prefix: str | None = None) -> None:
    """:func:`atomic_write_bytes` of ``text`` encoded as UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"), temp_prefix)


def link_or_special(path: Path | str) -> str | None:
    """What ``path`` is when it is something a writer must not open: "a symbolic link (to X)"
    or "not a regular file"; None when it is absent or a regular file. Never follows a link."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        try:
            return f"a symbolic link (to {os.readlink(path)})"
        except OSError:
            return "a symbolic link"
    return None if stat.S_ISREG(st.st_mode) else "not a regular file"


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
