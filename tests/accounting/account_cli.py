"""``userdp account ...`` in a child process, as a user runs it (exit status, stdout, stderr)."""

from __future__ import annotations

import subprocess
import sys


def account(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    code = "import sys; from userdp.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, "account", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
