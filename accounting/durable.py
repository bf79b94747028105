"""Durable-file primitives: every file that must survive a crash is written through this module.

A write is durable once the file's data is fsync'd; a new or renamed file is durable once its
directory entry is too (:func:`fsync_path` of the directory). A file that is REPLACED (a report,
a checkpoint's ``LATEST`` pointer, a cache entry) goes through :func:`atomic_write`: a temporary
file in the same folder is written and fsync'd, renamed over the target with ``os.replace`` and
the folder fsync'd, so a crash leaves the old content or the new one, never a torn file.
An append-only file (the ledger, the release journal) grows through :func:`append_durably`: all
of a record is written and fsync'd, or the file is cut back to what it held before.
:func:`atomic_write_bytes`, :func:`atomic_write_text` and :func:`atomic_write_json` are its
common forms. Plain ``os`` calls only, so :mod:`userdp.accounting` stays free of torch and of the
server.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "TornAppendError",
    "append_durably",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "fsync_path",
    "publish_directory",
    "truncate_durably",
    "write_all",
]


def fsync_path(path: Path) -> None:
    """fsync ``path``: a file's data (one a library wrote by name, e.g. safetensors), or a
    directory's entries, making the files created or renamed in it durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_directory(staging: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Make the folder ``staging`` durable (every file and folder in it fsync'd) and rename it to
    ``target`` in the same parent, whose entry is fsync'd too: a crash leaves no target or the
    whole one. ``OSError`` when ``target`` exists (another writer published first)."""
    staging, target = Path(staging), Path(target)
    for folder, _, files in os.walk(staging):
        for name in files:
            fsync_path(Path(folder) / name)
        fsync_path(Path(folder))
    os.rename(staging, target)
    fsync_path(target.parent)


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``, retrying short writes (an ``OSError`` propagates)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class TornAppendError(OSError):
    """An append failed and cutting its partial bytes off failed too: the file may end in a torn
    record. ``append_error`` and ``undo_error`` are the two ``OSError`` s."""

    def __init__(self, append_error: OSError, undo_error: OSError) -> None:
        super().__init__(undo_error.errno, undo_error.strerror or str(undo_error))
        self.append_error = append_error
        self.undo_error = undo_error


def append_durably(fd: int, data: bytes) -> None:
    """Append all of ``data`` at the end of the file open as ``fd`` and fsync it, or leave the file
    as it was: on an ``OSError`` the file is cut back to its length before (and fsync'd) and the
    error propagates; :class:`TornAppendError` when the cut fails too."""
    end = os.lseek(fd, 0, os.SEEK_END)
    try:
        write_all(fd, data)
        os.fsync(fd)
    except OSError as exc:
        try:
            os.ftruncate(fd, end)
            os.fsync(fd)
        except OSError as undo:
            raise TornAppendError(exc, undo) from exc
        raise


def truncate_durably(path: str | os.PathLike[str], size: int) -> None:
    """Cut the file ``path`` to ``size`` bytes and fsync it (an append-only file's torn tail)."""
    with open(path, "r+b") as handle:
        handle.truncate(size)
        handle.flush()
        os.fsync(handle.fileno())


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], None]) -> None:
    """Make ``path`` hold what ``write(temporary)`` writes to the temporary file it is given,
    durably and atomically (the module docstring). On any error the temporary file is removed
    and the error propagates; ``path`` then still holds its previous content (or is absent)."""
    path = Path(path)
    temporary = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        write(temporary)
        fsync_path(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """:func:`atomic_write` of ``data``; the file gets the permissions ``open`` would give it."""

    def write(temporary: Path) -> None:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            write_all(fd, data)
        finally:
            os.close(fd)

    atomic_write(path, write)


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    """:func:`atomic_write` of ``text`` encoded with ``encoding``."""
    atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: str | os.PathLike[str], value: Any, **dumps: Any) -> None:
    """:func:`atomic_write` of ``json.dumps(value, **dumps)`` (UTF-8)."""
    atomic_write_text(path, json.dumps(value, **dumps))
