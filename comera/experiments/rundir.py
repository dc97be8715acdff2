"""A run directory, held by one run at a time and checked writable before any training.

    with hold_run_directory(Path("runs/latest")):   # creates it; refuses a busy or unwritable one
        ...train, checkpoint, write the summary...

Two runs on one ``--out`` would interleave their checkpoints and summaries, so a run takes an
exclusive ``fcntl.flock`` on ``<out>/.comera.lock`` (holding its pid) for its whole life. The
kernel drops the lock when the process ends, also after SIGKILL, so a killed run never blocks the
next one; the lock file is removed on a clean exit. :func:`check_run_directory` asks the same
questions without taking anything (and without writing into the directory), for a launcher that
checks before it starts its workers.

Whoever can write the folder before the run may plant links in it. The lock is opened with
``O_NOFOLLOW``, and a lock or ``checkpoints`` folder that is a symbolic link (or a lock that is
not a regular file) is refused up front; every other file is written by
``tncomp.files.atomic_write_bytes``, which replaces a planted link instead of writing through
it. Temp files that killed writes left (``.*.part``) are swept when a run takes the folder.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from comera.errors import ConfigError
from tncomp.files import O_NOFOLLOW, link_or_special, sweep_temp_files

LOCK_NAME = ".comera.lock"
CHECKPOINTS = "checkpoints"
_held: dict[tuple[int, str], int] = {}  # (pid, directory) -> depth, for nested holds

try:  # POSIX; elsewhere runs are not locked (documented in hold_run_directory)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


def _probe_writable(directory: Path, what: str) -> None:
    """Create and drop an unnamed temp file in ``directory``: the honest writability test (root
    passes ``os.access`` on directories it still cannot write, e.g. on read-only mounts)."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise ConfigError(f"{what} {directory} is not writable ({exc.strerror or exc}); choose a "
                          "directory you can write to with --out.") from None


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _holder(lock: Path) -> str:
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NONBLOCK | O_NOFOLLOW)
        try:
            pid = os.read(fd, 32).decode(errors="replace").strip()
        finally:
            os.close(fd)
    except OSError:
        pid = ""
    return f"pid {pid}" if pid.isdigit() else "another process"


def _busy(out: Path, lock: Path) -> ConfigError:
    return ConfigError(f"--out {out} is in use by another run ({_holder(lock)}); wait for it to "
                       "finish or choose another --out.")


def _refuse_links(out: Path) -> None:
    """Refuse a lock or checkpoint folder planted as a link (or a lock that is a FIFO, a device
    or a folder): the run would write through it into a file it does not own."""
    for path, what in ((out / LOCK_NAME, "the run lock"), (out / CHECKPOINTS, None)):
        found = link_or_special(path)
        if found is None or (what is None and found == "not a regular file" and path.is_dir()):
            continue
        raise ConfigError(f"--out {out}: {path} is {found}; a run does not write through it. "
                          f"Remove it (rm {path}) or choose another --out.")


def check_run_directory(out: Path | str) -> None:
    """Refuse ``out`` if a run holds it, it cannot be written, or its lock or checkpoint folder
    is a planted link; create and write nothing."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory; choose a directory.")
    if not out.exists():
        base = _existing_ancestor(out)
        if not base.is_dir():
            raise ConfigError(f"--out {out}: {base} is a file, not a directory; choose another "
                              "--out.")
        _probe_writable(base, f"--out {out} cannot be created: its parent")
        return
    _probe_writable(out, "--out")
    _refuse_links(out)
    if (out / CHECKPOINTS).is_dir():
        _probe_writable(out / CHECKPOINTS, "the checkpoint directory")
    lock = out / LOCK_NAME
    if fcntl is None or not lock.is_file():
        return
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NONBLOCK | O_NOFOLLOW)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise _busy(out, lock) from None
        raise
    finally:
        os.close(fd)  # also drops the shared lock


@contextlib.contextmanager
def hold_run_directory(out: Path | str) -> Iterator[Path]:
    """Create ``out``, check it is writable and hold it exclusively until the block ends.

    Another process gets a :class:`~comera.errors.ConfigError` naming this one's pid at once;
    this process may nest holds (an experiment holds the directory around each model's run).
    Taking the folder sweeps the temp files that killed writes left in it and in its
    checkpoint folder, whatever their age (no other run can be writing them). Without
    ``fcntl`` (Windows) nothing is locked.
    """
    out = Path(out)
    key = (os.getpid(), str(out.resolve()))
    if key in _held:  # this process holds it already (an experiment around its runs)
        _held[key] += 1
        try:
            yield out
        finally:
            _held[key] -= 1
        return
    check_run_directory(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out} cannot be created ({exc.strerror or exc}); choose "
                          "another --out.") from None
    _probe_writable(out, "--out")
    if fcntl is None:  # pragma: no cover - Windows
        yield out
        return
    lock = out / LOCK_NAME
    fd = _acquire(out, lock)
    _held[key] = 1
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        _refuse_links(out)  # planted between the check and the lock
        for folder in (out, out / CHECKPOINTS):
            sweep_temp_files(folder, prefix=".")
        yield out
    finally:
        del _held[key]
        with contextlib.suppress(OSError):
            lock.unlink()  # while still holding it: the next run creates a fresh file
        os.close(fd)


def _acquire(out: Path, lock: Path) -> int:
    """Open and flock ``lock``; retry if a finishing holder unlinked it between open and lock."""
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | O_NOFOLLOW, 0o644)
        except OSError as exc:  # ELOOP: a link planted at the lock's name
            found = link_or_special(lock) or exc.strerror or str(exc)
            raise ConfigError(f"--out {out}: {lock} is {found}; a run does not write through "
                              f"it. Remove it (rm {lock}) or choose another --out.") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ConfigError(f"--out {out}: {lock} is not a regular file; remove it "
                              f"(rm {lock}) or choose another --out.")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise _busy(out, lock) from None
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
