"""Loopback coordinator + workers for the server tests (real gRPC, threads or processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from userdp.clients.grpc_client import Backoff, WorkerClient
from userdp.proto.channels import DEFAULT_MAX_MESSAGE_BYTES
from userdp.server.auth import Authorizer
from userdp.server.coordinator import Coordinator, CoordinatorSettings
from userdp.server.group_plane import GroupPlane
from userdp.server.grpc_server import RunningServer, serve
from userdp.server.publisher import ModelPublisher
from userdp.server.registry import WorkerRegistry
from userdp.server.sum_plane import StreamedPlane
from userdp.strategies.base import Release

from . import toy
from .standins import open_ledger, uls_strategy

TOY = Path(toy.__file__)
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Loopback:
    coordinator: Coordinator
    server: RunningServer
    clients: list[WorkerClient] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)

    def add_worker(
        self, worker_id, shards, compute=None, holdings=None, client_class=WorkerClient, **kwargs
    ) -> WorkerClient:
        population = self.coordinator.population
        client = client_class(
            self.server.address,
            worker_id,
            holdings or [(s, population.shard_sha256[s]) for s in shards],
            compute or toy.ToyCompute(),
            backoff=Backoff(initial_s=0.05, max_s=0.5),
            heartbeat_s=0.5,
            **kwargs,
        )
        errors = []

        def run():
            try:
                client.run()
            except Exception as exc:  # surfaced by tests that expect refusals
                errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        client.errors = errors
        self.clients.append(client)
        self.threads.append(thread)
        return client

    def wait_until_ready(self, worker_id: str, timeout_s: float = 300.0) -> None:
        """Pump the coordinator's events until ``worker_id`` holds the current model (a generous
        outer bound: only a broken worker reaches it)."""
        deadline = time.monotonic() + timeout_s
        while worker_id not in self.coordinator._eligible():
            assert time.monotonic() < deadline, f"worker {worker_id} never became ready"
            self.coordinator.pump_events(0.05)

    def restart(self, client: WorkerClient) -> None:
        client._stop = threading.Event()
        thread = threading.Thread(target=client.run, daemon=True)
        thread.start()
        self.threads.append(thread)

    def add_process(self, worker_id, shards, delay=0.0) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.server.toy",
                self.server.address,
                worker_id,
                ",".join(shards),
                str(delay),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.processes.append(proc)
        return proc

    def close(self):
        for client in self.clients:
            client.stop()
        for proc in self.processes:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self.server.stop(grace=0)
        for thread in self.threads:
            thread.join(timeout=5)
        self.coordinator.ledger.close()  # release the writer lock (a restart reopens it)


def make_loopback(
    tmp_path,
    *,
    strategy=None,
    ledger=None,
    settings=None,
    authorizer=None,
    tls=None,
    fault_hook=None,
    no_noise=True,
    population=None,
    port=0,
    publisher_chunk_bytes=64,
    max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES,
    params=None,
    group=None,
    checkpoint_dir=None,
    data_check=None,
) -> Loopback:
    """A coordinator serving on loopback; ``group``: a
    :class:`~userdp.server.group_plane.GroupSettings` for the collective data plane;
    ``checkpoint_dir``: default ``tmp_path/"ckpt"``; ``data_check``: the coordinator's."""
    population = population or toy.toy_population()
    registry = WorkerRegistry()
    publisher = ModelPublisher(chunk_bytes=publisher_chunk_bytes)
    server = serve(
        registry,
        publisher,
        authorizer or Authorizer.insecure(),
        population.shard_sha256,
        manifest_sha256=population.manifest_sha256,
        tls=tls,
        port=port,
        max_message_bytes=max_message_bytes,
    )
    coordinator = Coordinator(
        strategy=strategy or uls_strategy(),
        ledger=ledger or open_ledger(tmp_path / "ledger.jsonl"),
        params=toy.initial_params() if params is None else params,
        population=population,
        registry=registry,
        publisher=publisher,
        checkpoint_dir=checkpoint_dir or tmp_path / "ckpt",
        settings=settings
        or CoordinatorSettings(step_deadline_s=30, task_deadline_s=10, worker_startup_s=300),
        fault_hook=fault_hook,
        test_only_disable_noise=no_noise,
        plane=GroupPlane(group) if group is not None else StreamedPlane(),
        data_check=data_check,
    )
    try:
        coordinator.resume()
    except BaseException:
        server.stop(grace=0)
        coordinator.ledger.close()
        raise
    return Loopback(coordinator, server)


def reference_params(strategy, population, steps, start=None):
    """Single-process noiseless reference of `steps` steps of the toy model."""
    params = {n: t.clone() for n, t in (start or toy.initial_params()).items()}
    for step in range(steps):
        cohort = strategy.sample_cohort(step, population.users)
        sums, _ = toy.clipped_sum(cohort.unit_ids, params, strategy.clip_norm)
        noiseless = {n: s.to(torch.float32) for n, s in sums.items()}
        strategy.server_update(params, Release(step, cohort, noiseless))
    return params
