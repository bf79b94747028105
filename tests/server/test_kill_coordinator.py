"""SIGKILL a real coordinator process repeatedly and restart it: the ledger charges every update
that reached a worker, never charges a step twice, and the run completes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from userdp.server.checkpoint import load_latest

from .standins import ledger_steps

REPO = Path(__file__).resolve().parents[2]
STEPS = 12
PATIENCE_S = 600.0
"""Outer bound on each wait for the coordinator process (its start imports torch and gRPC, which
takes minutes on a loaded machine); the waits end as soon as the ledger shows the progress."""


def _start(directory: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-m", "tests.server.coordinator_proc", str(directory), str(STEPS)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def _ledger_len(directory: Path) -> int:
    path = directory / "ledger.jsonl"
    try:
        return len(ledger_steps(path)) if path.exists() else 0
    except Exception:  # the writer is mid-line; look again
        return 0


def test_sigkill_and_restart_keep_ledger_ahead_of_releases(tmp_path):
    kills = 0
    for target in (3, 7):  # kill once the ledger has this many entries
        proc = _start(tmp_path)
        deadline = time.monotonic() + PATIENCE_S
        while _ledger_len(tmp_path) < target and proc.poll() is None:
            assert time.monotonic() < deadline, (
                f"ledger below {target} entries after {PATIENCE_S} s"
            )
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
    proc = _start(tmp_path)
    out, _ = proc.communicate(timeout=PATIENCE_S)
    assert proc.returncode == 0 and "done" in out
    charged = ledger_steps(tmp_path / "ledger.jsonl")
    assert charged == sorted(set(charged)), f"a step was charged twice: {charged}"
    assert charged[-1] == STEPS - 1
    # each noisy update a worker received passed the ledger first: ε reported ≥ ε released
    lines = (tmp_path / "received.txt").read_text().split("\n")
    updates = {line.split()[0] for line in lines if line.endswith(" update")}
    assert len(updates) >= STEPS - 2 * kills  # the run really released updates
    assert len(updates) <= len(charged)
    checkpoint = load_latest(tmp_path / "ckpt")
    assert checkpoint.step == STEPS and checkpoint.ledger_entries == len(charged)
