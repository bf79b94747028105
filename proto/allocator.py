"""glibc allocator settings for the processes that stream tensor chunks (coordinator, workers).

A chunk message is a 4 MiB ``bytes`` object, and many are alive at once: the publisher keeps a
model version's chunks for resyncs, and a worker queues a partial sum's chunks faster than the
stream drains them. glibc serves each such block from a fresh ``mmap`` (its default threshold is
128 KiB and adapts only to blocks already freed), so every 4 KiB page of every chunk faults on
first touch: on the 2-core VM, 0.13 s per 400 MB, nine times the copy itself. With the mmap
threshold at glibc's maximum (32 MiB) the chunks come from the heap, and with a high trim
threshold freed heap memory stays mapped, so the next version's chunks reuse the previous one's
pages. The cost: the process keeps up to the trim threshold of freed memory instead of returning
it to the system.
"""

from __future__ import annotations

import ctypes
import platform

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

MMAP_THRESHOLD = 32 << 20
"""Blocks below this come from the heap (glibc refuses more than 32 MiB on 64-bit hosts)."""
TRIM_THRESHOLD = 1 << 30
"""Freed memory at the top of a heap is returned to the system only beyond this."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Apply the settings of the module docstring to this process; False where the C library is
    not glibc (the call then changes nothing)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
