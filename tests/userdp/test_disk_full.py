"""A full disk during a run (a real tmpfs filled just before one write): ``userdp simulate``
exits with one line and status 2 instead of hanging, the ledger verifies, and the same command
resumes and finishes once space is freed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path

import pytest

from userdp.config import parse_config
from userdp.run.outputs import config_toml

HERE = Path(__file__).resolve().parent
TMPFS_SIZE = "48m"


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of TMPFS_SIZE (root only; skipped where mounting is not permitted)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _config(tmp_path: Path, run: Path) -> Path:
    config = parse_config(
        {
            "data": {"demo_users": 40, "seq_len": 32, "eval_fraction": 0.1},
            "strategy": {"steps": 3, "sampling_prob": 0.25, "group_size": 2, "engine": "loop"},
            "privacy": {"epsilon": 20.0},
            "workers": {"count": 2},
            "coordinator": {"checkpoint_every": 1, "step_deadline_s": 300.0},
            "output": {"dir": str(run), "plots": False},
        }
    )
    path = tmp_path / "run.toml"
    path.write_text(config_toml(config))
    return path


def _userdp(args, *, point=None, call=0, filler=None):
    if point is None:
        command = [sys.executable, "-m", "userdp.cli", *args]
    else:
        command = [sys.executable, str(HERE / "fill_disk.py"), point, str(call), str(filler), "--"]
        command += args
    return subprocess.run(command, capture_output=True, text=True, timeout=900)


def run_full_disk_case(tmp_path, disk, point, call):
    run = disk / "run"
    config = _config(tmp_path, run)
    filler = disk / f"filler-{uuid.uuid4().hex}"
    args = ["simulate", "--config", str(config), "--quiet"]
    failed = _userdp(args, point=point, call=call, filler=filler)
    last = failed.stderr.strip().splitlines()[-1] if failed.stderr.strip() else ""
    assert failed.returncode == 2, f"{point}: exit {failed.returncode}\n{failed.stderr[-3000:]}"
    assert last.startswith("userdp simulate: error:") and "No space left on device" in last, last
    assert "Error while serializing" not in failed.stderr, "a raw serializer error reached the user"
    assert "not writable" not in last, last  # the cause is the full disk, and the note says so
    left = sorted(p.name for p in run.glob("checkpoints/.tmp-ckpt-*"))
    assert not left, f"{point}: temporary checkpoint folders left behind: {left}"
    if point == "checkpoint":
        assert "free space in" in last and "run the same command to resume" in last, last
    filler.unlink()  # space is freed
    if (run / "ledger.jsonl").is_file():
        verify = _userdp(["ledger", "verify", str(run)])
        if verify.returncode != 0 and "userdp ledger repair" in verify.stderr:
            assert _userdp(["ledger", "repair", str(run)]).returncode == 0
            verify = _userdp(["ledger", "verify", str(run)])
        assert verify.returncode == 0 or "stale" in verify.stderr, verify.stderr
    resumed = _userdp(args)
    assert resumed.returncode == 0, f"{point}: resume failed\n{resumed.stderr[-3000:]}"
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["stopped"] == "finished"
    verify = _userdp(["ledger", "verify", str(run)])
    assert verify.returncode == 0, verify.stderr
    state = json.loads(verify.stdout)
    assert state["steps"] == 3 and state["report"] == state["model"] == "current"
    assert tomllib.loads((run / "config.toml").read_text())["strategy"]["steps"] == 3
    shutil.rmtree(run)


@pytest.mark.slow  # a whole run; the ledger's own disk-full append: tests/accounting/test_ledger_faults.py
def test_disk_full_during_a_ledger_append(tmp_path, small_disk):
    run_full_disk_case(tmp_path, small_disk, "ledger", 3)  # header, step 0, then step 1


@pytest.mark.slow
@pytest.mark.parametrize("point, call", [("checkpoint", 2), ("journal", 2), ("report", 1)], ids=str)
def test_disk_full_at_other_writes(tmp_path, small_disk, point, call):
    run_full_disk_case(tmp_path, small_disk, point, call)
