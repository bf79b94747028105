"""The allocator settings of the streaming processes: chunk-sized blocks freed by one model
version are reused by the next without faulting their pages in again."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# A child process (the settings are process-wide): 100 live 4 MiB bytes objects, as a published
# model version keeps, then another 100 after the first are freed; prints the second round's
# minor page faults.
_CHILD = """
import resource, sys
from userdp.proto.allocator import keep_freed_memory
if sys.argv[1] == "tuned":
    assert keep_freed_memory()
chunk = bytes(range(256)) * ((4 << 20) // 256)
def version():  # each message: a header joined to a copy of the chunk's bytes, every page written
    return [b"".join((b"header", chunk)) for _ in range(100)]
held = version()
del held
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
held = version()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

PAGES = 100 * (4 << 20) // 4096  # pages of one version's chunks


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_a_second_version_reuses_the_first_versions_pages() -> None:
    # Every page of a fresh mapping faults when first written: the default allocator maps each
    # block afresh and faults nearly all pages again, the tuned one reuses them and faults few.
    assert _faults("default") > PAGES // 2
    assert _faults("tuned") < PAGES // 20
