"""The worker's gRPC side: health endpoint (liveness/readiness) and graceful drain."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from userdp.clients.grpc_client import WorkerHealth

from tests.server.harness import make_loopback

ALL = ["shard-00000", "shard-00001", "shard-00002", "shard-00003"]
SERVING = health_pb2.HealthCheckResponse.SERVING


def _status(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=30).status


def _eventually(predicate, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_worker_health_reports_liveness_and_readiness(tmp_path):
    health = WorkerHealth(0, host="127.0.0.1")
    loop = make_loopback(tmp_path)
    try:
        assert _status(health.port, "") == SERVING
        assert _status(health.port, "userdp.v1.Worker") != SERVING
        loop.add_worker("w0", ALL, health=health)
        loop.coordinator.wait_for_workers()
        assert _eventually(lambda: _status(health.port, "userdp.v1.Worker") == SERVING)
        loop.server.stop(grace=0)  # coordinator gone: not ready, but alive
        assert _eventually(lambda: _status(health.port, "userdp.v1.Worker") != SERVING)
        assert _status(health.port, "") == SERVING
    finally:
        loop.close()
        health.stop()


def test_drain_stops_new_tasks_and_exits(tmp_path):
    loop = make_loopback(tmp_path)
    try:
        leaving = loop.add_worker("a-leaving", ALL)
        loop.add_worker("b-staying", ALL)
        loop.coordinator.wait_for_workers()
        loop.coordinator.run(1)
        leaving.drain(timeout_s=5)
        loop.threads[0].join(5)
        assert not loop.threads[0].is_alive()
        done = leaving.tasks_done
        loop.coordinator.run(3)
        assert leaving.tasks_done == done
    finally:
        loop.close()


def _unused_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_worker_gives_up_once_the_coordinator_is_unreachable_for_its_timeout():
    import threading

    from userdp.clients.grpc_client import Backoff, CoordinatorUnreachableError, WorkerClient

    from tests.server.toy import ToyCompute

    client = WorkerClient(
        f"127.0.0.1:{_unused_port()}",  # nothing listens there
        "w0",
        [],
        ToyCompute(),
        backoff=Backoff(initial_s=0.05, max_s=0.2),
        reconnect_timeout_s=0.5,
    )
    raised = []

    def run():
        try:
            client.run()
        except CoordinatorUnreachableError as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=120)
    alive = thread.is_alive()
    client.stop()
    assert not alive, "the worker kept reconnecting past its reconnect timeout"
    assert len(raised) == 1 and raised[0].seconds >= 0.5
    assert str(raised[0]).startswith(f"coordinator {client.target} unreachable for ")


def test_a_worker_drained_by_a_finished_run_ends_without_reconnecting(tmp_path):
    loop = make_loopback(tmp_path)
    try:
        client = loop.add_worker("w0", ALL)
        loop.wait_until_ready("w0")
        loop.coordinator.run(1)
        loop.server.stop(grace=5, drain_workers=True)  # what a finished run does
        loop.threads[0].join(timeout=120)
        assert not loop.threads[0].is_alive(), "the drained worker is still running"
        assert client.errors == [] and client.sessions == 1
    finally:
        loop.close()
