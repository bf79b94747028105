"""The ``grpc`` and ``external`` transports of :func:`userdp.run.launch.run`: a running coordinator,
the worker processes it serves, and shutting both down.

``grpc`` (``simulate``) spawns ``workers.count`` ``userdp worker`` processes on loopback (each of
``workers.ranks`` ranks under torch's launcher), each holding its share of the shards
(:func:`_worker_assignments`), logging to ``RUN/logs/``, and
fails fast when one exits before it is ready (:func:`_check_workers_alive`). Every process it
starts (worker, launcher, rank) is tethered to its parent (:mod:`userdp.run.tether`): a
``simulate`` killed with SIGKILL leaves no worker behind. ``external``
(``train``) spawns nothing: it prints the address and waits for a deployment's workers.
:func:`serve_workers` drives the coordinator's steps into the run loop and, whatever happens,
saves the last checkpoint and stops the server and the processes (:func:`shut_down`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from userdp.run.loop import RunLoop, shut_down
from userdp.run.tether import PARENT_ENV
from userdp.server.startup import WorkerStartupError

log = logging.getLogger(__name__)

RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
TETHER = "userdp.run.tether"
WORKER_MODULE = "userdp.cli"
"""The module each worker process runs (``userdp worker``)."""


def _worker_assignments(shards: list[str], workers: int, replicas: int) -> list[list[str]]:
    """Shard j goes to workers j, j+1, … (mod W): ``replicas`` distinct holders per shard."""
    if replicas > workers:
        raise ValueError(f"workers.replicas = {replicas} > workers.count = {workers}")
    held: list[list[str]] = [[] for _ in range(workers)]
    for j, shard in enumerate(shards):
        for k in range(replicas):
            held[(j + k) % workers].append(shard)
    empty = [i for i, names in enumerate(held) if not names]
    if empty:
        raise ValueError(
            f"workers.count = {workers} exceeds what {len(shards)} shards x {replicas} replicas "
            "can keep busy; lower workers.count or raise workers.replicas"
        )
    return held


def _spawn_workers(loop: RunLoop, address: str) -> list[subprocess.Popen]:
    setup, config = loop.setup, loop.run_config
    shards = [entry.name for entry in setup.manifest.shards]
    held = _worker_assignments(shards, config.workers.count, config.workers.replicas)
    logs = loop.out / "logs"
    logs.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV}
    env["PYTHONUNBUFFERED"] = "1"  # each worker is its own process group
    ranks = config.workers.ranks
    if config.workers.device == "cuda" and ranks > torch.cuda.device_count():
        raise ValueError(
            f"workers.ranks = {ranks} with workers.device = 'cuda' needs {ranks} GPUs (one per "
            f"rank); this machine has {torch.cuda.device_count()}: lower workers.ranks"
        )
    threads = max(1, (os.cpu_count() or 1) // (len(held) * ranks))
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env[PARENT_ENV] = str(os.getpid())
    # each process ends with the one that started it (userdp.run.tether)
    launcher = [sys.executable, "-m", TETHER, "TERM"]
    if ranks > 1:  # torch's launcher: a free rendezvous port per worker, ranks' output here
        launcher += ["torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        launcher += ["-m", TETHER, "KILL"]
    procs = []
    for i, names in enumerate(held):
        cmd = [
            *launcher,
            WORKER_MODULE,
            "worker",
            "--coordinator",
            address,
            "--shards",
            str(setup.shard_dir),
            "--shard-names",
            ",".join(names),
            "--worker-id",
            f"sim-worker-{i}",
            "--config",
            str(loop.config_path),
        ]
        log_path = logs / f"worker-{i}.log"
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        proc.log_path = str(log_path)  # type: ignore[attr-defined]
        procs.append(proc)
    return procs


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][-300:] if lines else ""


def _check_workers_alive(procs: list[subprocess.Popen]) -> None:
    """Raise :class:`WorkerStartupError` naming the first worker process that has exited and
    the last line of its log (the wait for workers calls this while it waits)."""
    for proc in procs:
        if proc.poll() is not None:
            worker_id = proc.args[proc.args.index("--worker-id") + 1]
            log_path = Path(proc.log_path)
            last = _last_line(log_path)
            raise WorkerStartupError(
                f"worker {worker_id} exited with status {proc.returncode} before it was ready"
                + (f": {last}" if last else "")
                + f" (log: {log_path})"
            )


def _stop_workers(procs: list[subprocess.Popen], timeout: float = 30.0) -> None:
    """SIGTERM each worker process (a launcher passes it to its ranks), then SIGKILL what is
    left after ``timeout``: the process and everything under it (the launcher starts its ranks
    in sessions of their own, so its process group alone would miss them)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_tree(proc)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and every process under it, and reap it."""
    try:
        root = psutil.Process(proc.pid)
        tree = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        tree = []
    for process in tree:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def serve_workers(loop: RunLoop, running: Any, spawn: bool) -> tuple[dict[str, torch.Tensor], str]:
    """Run ``loop``'s steps on ``running`` (a started coordinator, from
    :func:`userdp.server.runtime.start_coordinator`): spawn the worker processes (``spawn``) or
    wait for external ones, then step until done, the budget or an interrupt. Returns the
    trained parameters and why it stopped ("finished" or "budget")."""
    setup = loop.setup
    coordinator = running.coordinator
    address = f"{loop.run_config.coordinator.host}:{running.server.port}"
    procs: list[subprocess.Popen] = []
    finished, stopped = False, "interrupted"

    def shutdown() -> list[BaseException]:
        return shut_down(
            ("save the last checkpoint", coordinator.save),
            ("stop the coordinator", lambda: running.stop(finished)),
            ("stop the worker processes", lambda: _stop_workers(procs)),
        )

    try:
        if spawn:
            procs += _spawn_workers(loop, address)
        else:
            print(f"userdp train: coordinator listening on {address}", file=sys.stderr, flush=True)
        coordinator.wait_for_workers(
            on_progress=loop.on_worker_progress, check=lambda: _check_workers_alive(procs)
        )
        loop.on_worker_progress([])

        def on_step(report: Any) -> None:
            loop.on_step(
                report.step,
                report.units,
                report.expected_cohort_size,
                report.stats.clipped,
                report.stats.nonfinite,
                report.stats.loss_mean,
                report.stats.tokens,
                setup.trainable,
            )

        coordinator.run(loop.steps, on_step=on_step)
        finished = True
        stopped = "budget" if coordinator.budget_exhausted else "finished"
    except BaseException:
        shutdown()  # its own failures are logged; the run's error is the one raised
        raise
    errors = shutdown()
    if errors:
        raise errors[0]
    return setup.trainable, stopped
