"""Processes that end with the process that started them: ``python -m userdp.run.tether SIGNAL
MODULE ARGS...`` runs MODULE as ``python -m MODULE ARGS...`` would, tied to its parent.

``simulate`` starts its workers (and, with ``workers.ranks > 1``, torch's launcher and each rank)
through it, so that a coordinator killed with SIGKILL leaves no worker behind: on Linux the
process asks the kernel for SIGNAL when its parent thread ends (``prctl(PR_SET_PDEATHSIG)``).
SIGTERM for the process ``simulate`` starts (a worker drains, torch's launcher ends its ranks),
SIGKILL for the ranks a launcher starts (ranks other than 0 ignore SIGTERM). The parent is the
process named by :data:`PARENT_ENV`: if it is no longer the parent when the request is made (it
died while this process started), this process ends at once. For the processes it starts, the
tether names itself in :data:`PARENT_ENV`, so a launcher's ranks can be tethered to it in turn.

Elsewhere than Linux there is no such request; there, and for workers nobody started (a
deployment's), the worker's reconnect timeout ends it (``workers.reconnect_timeout_s``,
docs/protocol.md).
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PARENT_ENV = "USERDP_TETHER_PARENT"
"""The pid of the process a tethered process must be a child of."""

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def tether(signum: int) -> bool:
    """Ask for ``signum`` when the parent ends; end now when the parent named by
    :data:`PARENT_ENV` is already gone. False where the kernel offers no such request."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        return False
    expected = os.environ.get(PARENT_ENV)
    if expected and os.getppid() != int(expected):
        os.kill(os.getpid(), signum)  # the parent died before the request: as if just now
    return True


def main(argv: list[str]) -> None:
    """``SIGNAL MODULE ARGS...`` (SIGNAL: ``TERM`` or ``KILL``): tether, then run MODULE."""
    if len(argv) < 2 or argv[0] not in ("TERM", "KILL"):
        raise SystemExit("usage: python -m userdp.run.tether TERM|KILL MODULE [ARGS...]")
    tether(signal.Signals[f"SIG{argv[0]}"])
    os.environ[PARENT_ENV] = str(os.getpid())
    sys.argv = [argv[1], *argv[2:]]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
