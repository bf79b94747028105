"""Waiting for workers by their progress: a slow worker that keeps reporting its start-up phase
is waited for well past the stall window; one that goes silent, or none at all, ends the wait
with one line naming the phase and the shards; reports are authenticated like Connect."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from userdp.clients.startup import StartupReporter
from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto import userdp_v1_pb2_grpc as pb_grpc
from userdp.proto.channels import bearer
from userdp.server.auth import Authorizer
from userdp.server.coordinator import CoordinatorSettings
from userdp.server.registry import StartupStatus, WorkerSession
from userdp.server.startup import StartupWait, WorkerStartupError, summarize

from .harness import make_loopback

ALL = ["shard-00000", "shard-00001", "shard-00002", "shard-00003"]
STALL_S = 3.0
"""The scaled-down stall window (the old fixed wait had this shape: give up after a bound)."""


def _settings(**kwargs) -> CoordinatorSettings:
    base = {"step_deadline_s": 30, "task_deadline_s": 10, "worker_stall_s": STALL_S}
    return CoordinatorSettings(**{**base, **kwargs})


def test_a_slow_worker_that_keeps_reporting_is_waited_for(tmp_path) -> None:
    """The worker spends three stall windows in start-up phases, reporting every 0.2 s, then
    connects: the coordinator waits for it and saw each phase on the way."""
    loop = make_loopback(tmp_path, settings=_settings())
    seen: list[str] = []
    try:
        reporter = StartupReporter(loop.server.address, "w-slow", ALL, interval_s=0.2)

        def start_slowly() -> None:
            for phase in ("loading model", "building DeepSpeed ops", "initializing DeepSpeed"):
                reporter.phase(phase)
                time.sleep(STALL_S)  # the slow start being simulated, not a wait of the test
            reporter.phase("connecting")
            loop.add_worker("w-slow", ALL, on_welcome=reporter.stop)

        started = time.monotonic()
        threading.Thread(target=start_slowly, daemon=True).start()
        loop.coordinator.wait_for_workers(
            on_progress=lambda starting: seen.extend(p.phase for p in starting)
        )
        waited = time.monotonic() - started
        reporter.close()
        loop.coordinator.run(1)
    finally:
        loop.close()
    assert waited >= 3 * STALL_S  # three stall windows, and the wait did not give up
    assert {"loading model", "building DeepSpeed ops", "initializing DeepSpeed"} <= set(seen)
    assert reporter.sent > 3 * STALL_S / 0.2 / 2  # it really reported all along


def _phase(loop, worker_id: str) -> str | None:
    status = loop.coordinator.registry.startup().get(worker_id)
    return None if status is None else status.phase


def test_a_worker_that_goes_silent_ends_the_wait_naming_its_phase(tmp_path) -> None:
    loop = make_loopback(tmp_path, settings=_settings())
    try:
        reporter = StartupReporter(loop.server.address, "w-dies", ALL[:2], interval_s=0.2)
        reporter.phase("building DeepSpeed ops")
        deadline = time.monotonic() + 120
        while _phase(loop, "w-dies") != "building DeepSpeed ops":  # not just the first report
            assert time.monotonic() < deadline, "no start-up report of the phase arrived"
            time.sleep(0.05)
        reporter.close()  # the process died: nothing more is heard from it
        with pytest.raises(WorkerStartupError) as raised:
            loop.coordinator.wait_for_workers()
    finally:
        loop.close()
    message = str(raised.value)
    assert "\n" not in message
    assert f"no start-up progress from any worker for {STALL_S:g} s" in message
    assert "coordinator.worker_stall_s" in message
    assert "w-dies in 'building DeepSpeed ops'" in message
    assert "shard-00000" in message and "shard-00003" in message


def test_with_no_worker_the_overall_bound_names_the_missing_shards(tmp_path) -> None:
    loop = make_loopback(tmp_path, settings=_settings())
    try:
        with pytest.raises(WorkerStartupError) as raised:
            loop.coordinator.wait_for_workers(timeout_s=0.5)
    finally:
        loop.close()
    message = str(raised.value)
    assert "coordinator.worker_startup_s = 0.5" in message
    assert "no worker connected or reported progress" in message
    assert all(shard in message for shard in ALL)


def test_check_raises_through_the_wait(tmp_path) -> None:
    loop = make_loopback(tmp_path, settings=_settings())

    def check() -> None:
        raise WorkerStartupError("worker w0 exited with status 1 before it was ready")

    try:
        with pytest.raises(WorkerStartupError, match="exited with status 1"):
            loop.coordinator.wait_for_workers(check=check)
    finally:
        loop.close()


def test_start_up_reports_are_authenticated_like_connect(tmp_path) -> None:
    token = "s3cret-token-0123456789"
    loop = make_loopback(tmp_path, authorizer=Authorizer.with_token(token, allowed_workers=["w0"]))
    report = pb.StartupReport(worker_id="w0", phase="loading model", shards=ALL)
    try:
        with grpc.insecure_channel(loop.server.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            with pytest.raises(grpc.RpcError) as missing:
                stub.ReportStartup(report, timeout=60)
            assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
            other = pb.StartupReport(worker_id="intruder", phase="loading model")
            with pytest.raises(grpc.RpcError) as unknown:
                stub.ReportStartup(other, metadata=bearer(token), timeout=60)
            assert unknown.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert loop.coordinator.registry.startup() == {}
            stub.ReportStartup(report, metadata=bearer(token), timeout=60)
        (status,) = loop.coordinator.registry.startup().values()
    finally:
        loop.close()
    assert status.worker_id == "w0" and status.phase == "loading model"
    assert status.shards == frozenset(ALL)


def _status(worker: str, phase: str, received: float, seconds: float = 1.0) -> StartupStatus:
    return StartupStatus(worker, phase, seconds, frozenset(ALL), received)


def _session(worker: str, shards, last_seen: float) -> WorkerSession:
    return WorkerSession(
        worker_id=worker,
        session_id="s",
        shards=frozenset(shards),
        capabilities=pb.Capabilities(),
        model_version=0,
        last_seen=last_seen,
    )


def test_wait_decisions_at_given_moments() -> None:
    wait = StartupWait(frozenset(ALL), startup_s=100.0, stall_s=10.0, started=0.0)
    # nobody heard from yet: only the overall bound applies
    assert wait.check({}, [], {}, now=99.0) == (False, [])
    with pytest.raises(WorkerStartupError, match="no worker connected"):
        wait.check({}, [], {}, now=101.0)
    # a report 9 s old keeps the wait going; 11 s old ends it
    reports = {"a": _status("a", "loading model", received=50.0)}
    done, starting = wait.check({}, [], reports, now=59.0)
    assert not done and [p.worker_id for p in starting] == ["a"]
    assert starting[0].phase_seconds == pytest.approx(10.0)
    assert summarize(starting) == "a: loading model 10s"
    with pytest.raises(WorkerStartupError, match="'loading model'"):
        wait.check({}, [], reports, now=61.0)
    # one worker still progressing is enough to keep waiting
    reports["b"] = _status("b", "building DeepSpeed ops", received=60.0)
    assert not wait.check({}, [], reports, now=65.0)[0]
    # a connected session counts as heard from; ready holders of every shard end the wait
    ready = _session("b", ALL, last_seen=64.0)
    assert wait.check({"b": ready}, [ready], reports, now=65.0) == (True, [])
    half = _session("b", ALL[:2], last_seen=64.0)
    reports["a"] = _status("a", "loading model", received=60.0)
    done, starting = wait.check({"b": half}, [half], reports, now=65.0)
    assert not done and [p.worker_id for p in starting] == ["a"]
    with pytest.raises(WorkerStartupError, match="no ready worker holds shard-00002, shard-00003"):
        wait.check({"b": half}, [half], reports, now=71.0)


def test_the_reporter_logs_each_phase_once(tmp_path, caplog) -> None:
    """The worker's own log shows its start-up (reports to an absent coordinator are retried
    quietly, never raised)."""
    with caplog.at_level("INFO", logger="userdp.worker"):
        reporter = StartupReporter("127.0.0.1:9", "w0", ALL, interval_s=0.05)
        for phase in ("loading model", "loading model", "building DeepSpeed ops"):
            reporter.phase(phase)
        reporter.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "userdp.worker"]
    assert lines == [
        "worker w0: starting",
        "worker w0: loading model",
        "worker w0: building DeepSpeed ops",
    ]
    assert reporter.current == "building DeepSpeed ops" and reporter.sent == 0
