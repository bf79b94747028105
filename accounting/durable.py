"""Durable-file primitives shared by the privacy ledger and the coordinator's checkpoints.

A write is durable once the file's data is fsync'd; a new or renamed file is durable once its
directory entry is too (:func:`fsync_dir`). Plain ``os`` calls only, so :mod:`userdp.accounting`
stays free of torch and of the server.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """fsync the directory ``path``, making the files created or renamed in it durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``, retrying short writes (an ``OSError`` propagates)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
