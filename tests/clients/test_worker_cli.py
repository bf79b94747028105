"""`userdp worker` as a process: it verifies its shards at start unless told `--no-verify`, and
it gives up (exit 4, one line) once the coordinator has been unreachable for
`--reconnect-timeout` seconds."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from userdp.run.components import demo_shards

ERROR_PREFIX = "userdp worker: error: "


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def truncated_shards(tmp_path: Path) -> Path:
    """A copy of the demo shards whose first shard file lost its last 100 bytes."""
    shards = tmp_path / "shards"
    shutil.copytree(demo_shards(40), shards)
    victim = shards / "shard-00000.arrow"
    os.truncate(victim, victim.stat().st_size - 100)
    return shards


def _worker(shards: Path, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "userdp.cli", "worker", "--coordinator"]
    argv += [f"127.0.0.1:{_unused_port()}", "--shards", str(shards), "--worker-id", "w0", *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("flags", [[], ["--verify"]], ids=["default", "--verify"])
def test_a_truncated_shard_stops_the_worker_at_start_in_one_line(truncated_shards, flags):
    result = _worker(truncated_shards, *flags)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if "error" in line.lower()]
    assert errors == [lines[-1]], result.stderr[-3000:]
    assert lines[-1].startswith(f"{ERROR_PREFIX}{truncated_shards / 'shard-00000.arrow'}: sha256")
    assert "does not match the manifest" in lines[-1]
    assert any(line.endswith("worker w0: verifying shards") for line in lines)


def test_no_verify_warns_once_and_an_unreachable_coordinator_ends_the_worker(truncated_shards):
    result = _worker(truncated_shards, "--no-verify", "--reconnect-timeout", "1")
    assert result.returncode == 4, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    skipped = [line for line in lines if "--no-verify" in line]
    assert len(skipped) == 1 and " WARNING userdp.worker: worker w0: --no-verify: " in skipped[0]
    assert not any("verifying shards" in line for line in lines)
    errors = [line for line in lines if " ERROR " in line or ERROR_PREFIX in line]
    assert errors == [lines[-1]], result.stderr[-3000:]
    assert "worker w0: coordinator 127.0.0.1:" in lines[-1]
    assert (
        "unreachable for" in lines[-1]
        and "workers.reconnect_timeout_s or --reconnect-timeout" in lines[-1]
    )


def test_a_negative_reconnect_timeout_is_refused(tmp_path, capsys):
    from userdp.cli import main

    code = main(
        ["worker", "--coordinator", "127.0.0.1:1", "--shards", str(tmp_path)]
        + ["--reconnect-timeout", "-1"]
    )
    assert code == 2
    assert "--reconnect-timeout must be >= 0" in capsys.readouterr().err


def test_the_configs_reconnect_timeout_ends_a_worker_without_the_flag(truncated_shards, tmp_path):
    config = tmp_path / "worker.toml"
    config.write_text("[workers]\nreconnect_timeout_s = 1.0\n")
    result = _worker(truncated_shards, "--no-verify", "--config", str(config))
    assert result.returncode == 4, result.stderr[-3000:]
    assert " unreachable for 1s; giving up " in result.stderr.strip().splitlines()[-1]
