"""``python -m userdp.run.tether SIGNAL MODULE ARGS...``: MODULE runs as ``python -m`` would run
it, names itself for its own children, and ends when its parent ends, also when the parent died
before the tether could ask for it (Linux)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from userdp.run.tether import PARENT_ENV

REPO = Path(__file__).resolve().parents[2]
CHILD = "tests.userdp.tethered_child"
PATIENCE_S = 120.0

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != PARENT_ENV}
    return env | {"PYTHONPATH": str(REPO), **extra}


def _tethered(*args: str) -> list[str]:
    return [sys.executable, "-m", "userdp.run.tether", "TERM", CHILD, *args]


def test_the_module_runs_with_its_arguments_and_exit_status_and_names_itself() -> None:
    proc = subprocess.run(
        _tethered("3", "--flag"),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(),
        timeout=PATIENCE_S,
    )
    assert proc.returncode == 3, proc.stderr
    said = json.loads(proc.stdout)
    assert said["argv"] == ["3", "--flag"]
    assert said["parent_env"] == str(said["pid"])  # its children are tethered to it


def test_a_tethered_process_ends_when_its_parent_is_sigkilled() -> None:
    """The parent starts a tethered child and is SIGKILLed: the child gets SIGTERM at once."""
    parent_code = (
        f"import subprocess, sys, time;p = subprocess.Popen({_tethered()!r});time.sleep(3600)"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], stdout=subprocess.PIPE, cwd=REPO, env=_env()
    )
    child = None
    try:
        said = json.loads(parent.stdout.readline())  # the child's line: it is running
        child = psutil.Process(said["pid"])
        assert child.ppid() == parent.pid
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + PATIENCE_S
        while child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the tethered child outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()
        if child is not None and child.is_running():
            child.kill()


def test_a_process_whose_parent_died_while_it_started_ends_at_once() -> None:
    """The tether names the parent it must have; when it has another one (the named parent died
    and the process was re-parented), it ends with its signal before the module runs."""
    not_the_parent = str(os.getppid())  # pytest's parent, never the tethered process's
    proc = subprocess.run(
        _tethered(),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(**{PARENT_ENV: not_the_parent}),
        timeout=PATIENCE_S,
    )
    assert proc.returncode == -signal.SIGTERM
    assert proc.stdout == ""  # the module never ran


def test_a_bad_signal_name_is_one_usage_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "userdp.run.tether", "HUP", CHILD],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(),
        timeout=PATIENCE_S,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == "usage: python -m userdp.run.tether TERM|KILL MODULE [ARGS...]"
