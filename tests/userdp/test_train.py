"""``userdp train`` against separately started workers (a deployment's shape, on loopback)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from userdp.run.components import demo_shards


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_train_runs_with_workers_started_on_their_own(tmp_path: Path) -> None:
    shards = demo_shards(40)
    port = _free_port()
    config = tmp_path / "run.toml"
    config.write_text(
        f"""
[data]
shards = "{shards}"
seq_len = 32
[strategy]
steps = 2
sampling_prob = 0.3
group_size = 2
engine = "loop"
[privacy]
epsilon = 20.0
[coordinator]
port = {port}
step_deadline_s = 120.0
[output]
dir = "{tmp_path / "run"}"
plots = false
seed = 0
"""
    )
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cli = [sys.executable, "-m", "userdp.cli"]
    train = subprocess.Popen(
        [*cli, "train", "--config", str(config), "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    workers = [
        subprocess.Popen(
            [*cli, "worker", "--coordinator", f"127.0.0.1:{port}", "--shards", str(shards)]
            + ["--shard-names", names, "--config", str(config), "--worker-id", f"w{i}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        # Disjoint shards: the coordinator starts only when both workers hold theirs, so both
        # are connected when the finished run drains them (a worker that came up after the run
        # would wait for a coordinator with backoff, as designed).
        for i, names in enumerate(("shard-00000,shard-00002", "shard-00001,shard-00003"))
    ]
    try:
        out, err = train.communicate(timeout=300)
        assert train.returncode == 0, err[-2000:]
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["stopped"] == "finished" and summary["steps"] == 2
        report = json.loads((tmp_path / "run" / "privacy_report.json").read_text())
        assert report["steps"] == 2 and report["epsilon"] <= 20.0
        for worker in workers:  # drained by the finished coordinator: they exit on their own
            assert worker.wait(timeout=300) == 0
    finally:
        for proc in [train, *workers]:
            if proc.poll() is None:
                proc.kill()
