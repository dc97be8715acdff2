"""Torch files on disk, safely: written atomically, read without running code.

The one home of comera's ``torch.save`` / ``torch.load`` of files it owns (checkpoints, the data
cache). :func:`write_torch_file` serialises to memory and writes through
``tncomp.files.atomic_write_bytes`` (temp file, fsync, rename), so a reader sees the old file, the
new one or none. :func:`read_torch_file` loads with ``weights_only=True``: tensors and plain
containers only, so a planted pickle is refused before any of it runs. Torch's weights-only errors
span many lines with terminal colour codes; :func:`load_error_reason` makes them one plain line
and :func:`refused_global` names the Python object a file asked to unpickle. A file that is not
a torch file at all (empty, text, another format) is refused by its first bytes, before torch
reads it (torch's own errors for those are raw ones such as ``IndexError``), and
:func:`peek_torch_file` says what a file holds without running any of it.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tncomp.files import atomic_write_bytes

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# the object a weights-only load refused: torch names it in one of two sentences (an allowed
# module's object not on the allow list; an object of a module it blocks, such as os)
_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)|unsupported GLOBAL (\S+) whose module")
MAX_REASON = 1000  # characters of a load error kept: the whole of torch's, not a runaway text
# how every torch.save file begins: its zip archive, or the legacy format's pickle protocol byte
MAGIC = (b"PK\x03\x04", b"\x80")


class NotATorchFileError(ValueError):
    """A file whose first bytes are not those of any ``torch.save`` file."""


def write_torch_file(path: Path | str | os.PathLike, obj: Any) -> None:
    """``torch.save(obj)`` to ``path`` atomically (the directory must exist; ``OSError`` on
    failure, with nothing left behind)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(Path(path), buffer.getbuffer())


def read_torch_file(path: Path | str | os.PathLike) -> Any:
    """``torch.load(path)`` on the CPU with ``weights_only=True`` (never unpickles code).
    :class:`NotATorchFileError` for a file that does not begin as a torch file does."""
    check_torch_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def check_torch_file(path: Path | str | os.PathLike) -> None:
    """Raise :class:`NotATorchFileError` (a ``ValueError``) naming what ``path`` begins with
    when it is empty or does not begin as a ``torch.save`` file does."""
    with open(path, "rb") as f:
        head = f.read(16)
    if not head:
        raise NotATorchFileError("not a torch file: it is empty (0 bytes)")
    if not head.startswith(MAGIC):
        raise NotATorchFileError(f"not a torch file: it begins with {head!r}, where a "
                                 "torch.save file begins with a zip header or a pickle")


def peek_torch_file(path: Path | str | os.PathLike) -> tuple[str, Any]:
    """What a torch file holds, read with ``weights_only=True`` (nothing in it runs):
    ``("data", the object)`` for tensors and plain containers, ``("object", "module.Name")``
    for a pickle of other Python objects (a whole model, say), ``("unreadable", why)`` for
    anything else (``why`` one plain line)."""
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": the answer says it
            warnings.simplefilter("ignore")
            return "data", read_torch_file(path)
    except Exception as exc:
        found = refused_global(exc)
        return ("object", found) if found else ("unreadable", load_error_reason(exc))


def update_digest(h: Any, obj: Any) -> None:
    """Feed ``obj`` (nested dicts / lists / tensors / scalars) into the hash ``h`` in order: the
    one content hash of comera's files (checkpoint checksums, data-cache checksums)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(obj, Mapping):
        h.update(f"D{len(obj)}".encode())
        for key, value in obj.items():
            h.update(f"K{key!r}".encode())
            update_digest(h, value)
    elif isinstance(obj, list | tuple):
        h.update(f"L{len(obj)}".encode())
        for value in obj:
            update_digest(h, value)
    else:
        h.update(f"S{obj!r}".encode())


def content_digest(obj: Any) -> str:
    """The sha256 of ``obj``'s contents (:func:`update_digest`) as hex."""
    h = hashlib.sha256()
    update_digest(h, obj)
    return h.hexdigest()


def refused_global(exc: BaseException) -> str | None:
    """The Python object (``module.Name``) a weights-only load refused to unpickle, if that is
    what ``exc`` reports; None for any other error."""
    if not isinstance(exc, pickle.UnpicklingError):
        return None
    found = _GLOBAL.search(str(exc))
    return (found.group(1) or found.group(2)).rstrip(".") if found else None


def load_error_reason(exc: BaseException) -> str:
    """``exc`` of a failed load as one plain line: its type and its whole message (torch's
    weights-only errors from their "WeightsUnpickler error:" on; torch's advice to retry with
    ``weights_only=False`` kept with its warning that this can run arbitrary code)."""
    text = _ANSI.sub("", str(exc))
    _, marker, rest = text.partition("WeightsUnpickler error:")
    line = " ".join(line.strip() for line in (rest if marker else text).splitlines()
                    if line.strip())
    if len(line) > MAX_REASON:
        line = line[:MAX_REASON - 3] + "..."
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


__all__ = ["NotATorchFileError", "check_torch_file", "content_digest", "load_error_reason",
           "peek_torch_file", "read_torch_file", "refused_global", "update_digest",
           "write_torch_file"]
