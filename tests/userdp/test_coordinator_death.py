"""A coordinator killed with SIGKILL leaves no worker behind.

``simulate`` runs its coordinator in its own process and starts the workers (and, with
``workers.ranks > 1``, torch's launcher and its ranks) tethered to it
(:mod:`userdp.run.tether`): with the workers' reconnect timeout off (``0`` = forever), only the
tether can end them, and every one of them is gone soon after ``simulate`` is SIGKILLed — over the
gRPC data plane, the collective one, and at ZeRO-3 with two ranks per worker. A deployment's
worker has no such parent: ``userdp train`` (the coordinator) is SIGKILLed and its worker, started
apart from it, ends once its reconnect timeout has passed, with status 4 and one line.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from userdp.config import parse_config
from userdp.run.components import prepare_run
from userdp.run.outputs import config_toml

PATIENCE_S = 900.0
"""Outer bound on the wait for the first released step (imports, model, DeepSpeed's op, on a
loaded 2-core machine); the wait ends as soon as the ledger shows it."""

TETHER_BOUND_S = 90.0
"""A tethered worker gets SIGTERM when ``simulate`` dies and drains at once (its coordinator is
gone); torch's launcher ends its ranks within its own 30 s. Generous for a loaded machine: the
processes are usually gone within a few seconds."""

KEEPALIVE_S = 30.0
"""gRPC keepalive: a silent coordinator host breaks the stream within this (docs/protocol.md)."""


def _config(tmp_path: Path, *, plane: str = "grpc", ranks: int = 1, reconnect_s: float = 0.0):
    workers = {"count": 1 if ranks > 1 else 2, "ranks": ranks, "reconnect_timeout_s": reconnect_s}
    return parse_config(
        {
            "data": {"demo_users": 40, "seq_len": 32, "eval_fraction": 0.1},
            "model": {"preset": "gpt2-tiny", "zero_stage": 3 if ranks > 1 else 0},
            "strategy": {
                "steps": 200,  # far more than run before the kill
                "sampling_prob": 0.25,
                "group_size": 2,
                "engine": "vectorized" if ranks > 1 else "loop",
                "server_optimizer": "sgd",
                "server_lr": 0.5,
            },
            "privacy": {"epsilon": 20.0},
            "workers": workers,
            "coordinator": {"step_deadline_s": 300.0, "data_plane": plane},
            "output": {"dir": str(tmp_path / "run"), "seed": 0, "plots": False},
        }
    )


def _ledger_steps(run_dir: Path) -> int:
    try:
        lines = (run_dir / "ledger.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return sum(1 for line in lines if line.startswith("{") and '"step"' in line)


def _wait_for_a_step(proc: subprocess.Popen, run_dir: Path) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while _ledger_steps(run_dir) < 1:
        assert proc.poll() is None, f"the coordinator exited with {proc.returncode} before a step"
        assert time.monotonic() < deadline, f"no step released within {PATIENCE_S:.0f} s"
        time.sleep(0.2)


def _alive(process: psutil.Process) -> bool:
    """Running, and not a zombie (an orphan's zombie waits only for init to reap it)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _seconds_until_gone(processes: list[psutil.Process]) -> float:
    """Seconds until none of ``processes`` is alive (polled; fails after a generous wait)."""
    started = time.monotonic()
    while any(_alive(p) for p in processes):
        left = [" ".join(p.cmdline()[-8:]) for p in processes if _alive(p)]
        assert time.monotonic() - started < PATIENCE_S, f"still running: {left}"
        time.sleep(0.1)
    return time.monotonic() - started


def _kill_all(processes: list[psutil.Process]) -> None:
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def _simulate(config, tmp_path: Path) -> subprocess.Popen:
    path = tmp_path / "run.toml"
    path.write_text(config_toml(config))
    log = open(tmp_path / "simulate.log", "wb")  # noqa: SIM115 - closed with the process
    argv = [sys.executable, "-m", "userdp.cli", "simulate", "--config", str(path), "--quiet"]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc


def _sigkill_simulate_and_time_its_workers(config, tmp_path: Path, expected: int) -> float:
    """Start ``simulate``, SIGKILL it once a step was released, and return how long its
    ``expected`` worker processes (workers, launchers, ranks) took to end."""
    proc = _simulate(config, tmp_path)
    descendants: list[psutil.Process] = []
    try:
        _wait_for_a_step(proc, tmp_path / "run")
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert len(descendants) == expected, [p.cmdline() for p in descendants]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        seconds = _seconds_until_gone(descendants)
    finally:
        proc.kill()
        proc.wait()
        _kill_all(descendants)
    for path in (tmp_path / "run" / "logs").glob("worker-*.log"):
        text = path.read_text(errors="replace")
        # a worker leaves gloo before it exits: no abort at exit
        assert "terminate called" not in text and "Fatal Python error" not in text, text[-3000:]
    return seconds


def test_simulates_workers_end_when_it_is_sigkilled(tmp_path) -> None:
    seconds = _sigkill_simulate_and_time_its_workers(_config(tmp_path), tmp_path, expected=2)
    assert seconds < TETHER_BOUND_S


@pytest.mark.slow
def test_simulates_collective_plane_workers_end_when_it_is_sigkilled(tmp_path) -> None:
    config = _config(tmp_path, plane="collective")
    seconds = _sigkill_simulate_and_time_its_workers(config, tmp_path, expected=2)
    assert seconds < TETHER_BOUND_S


@pytest.mark.slow
def test_simulates_zero3_launcher_and_ranks_end_when_it_is_sigkilled(tmp_path) -> None:
    config = _config(tmp_path, ranks=2)
    seconds = _sigkill_simulate_and_time_its_workers(config, tmp_path, expected=3)
    assert seconds < TETHER_BOUND_S


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_a_deployments_worker_ends_once_its_reconnect_timeout_has_passed(tmp_path) -> None:
    """The Kubernetes shape: ``userdp train`` serves a fixed port and a ``userdp worker`` that
    it did not start connects to it. Once ``train`` is SIGKILLed the worker's stream breaks at
    once; it keeps reconnecting for ``workers.reconnect_timeout_s`` and then exits with status 4,
    its last line naming the setting."""
    reconnect_s = 5.0
    config = _config(tmp_path, reconnect_s=reconnect_s)
    config = config.model_copy(
        update={"coordinator": config.coordinator.model_copy(update={"port": _free_port()})}
    )
    path = tmp_path / "run.toml"
    path.write_text(config_toml(config))
    shards = prepare_run(config).shard_dir
    cli = [sys.executable, "-m", "userdp.cli"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(tmp_path / "train.log", "wb") as log:
        train = subprocess.Popen(
            [*cli, "train", "--config", str(path), "--quiet"], stdout=log, stderr=log
        )
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen(
            [*cli, "worker", "--coordinator", f"127.0.0.1:{config.coordinator.port}"]
            + ["--shards", str(shards), "--config", str(path), "--worker-id", "w0"],
            stdout=log,
            stderr=log,
            env=env,
        )
    try:
        _wait_for_a_step(train, tmp_path / "run")
        assert worker.poll() is None
        train.send_signal(signal.SIGKILL)
        train.wait()
        seconds = _seconds_until_gone([psutil.Process(worker.pid)])
        assert worker.wait() == 4
    finally:
        for proc in (train, worker):
            proc.kill()
            proc.wait()
    assert seconds < reconnect_s + KEEPALIVE_S + TETHER_BOUND_S
    last = (tmp_path / "worker.log").read_text().strip().splitlines()[-1]
    assert "worker w0: coordinator 127.0.0.1:" in last and " unreachable for " in last, last
    assert "set workers.reconnect_timeout_s or --reconnect-timeout" in last, last
