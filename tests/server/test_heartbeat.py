"""A worker that stops talking (no results, no heartbeats) is treated as lost, so its tasks are
re-issued instead of waiting for the task deadline."""

from __future__ import annotations

import time

from userdp.proto import userdp_v1_pb2 as pb
from userdp.server.registry import WorkerLost, WorkerRegistry, WorkerSession


def _session(worker_id: str, last_seen: float) -> WorkerSession:
    return WorkerSession(
        worker_id=worker_id,
        session_id=f"{worker_id}-s",
        shards=frozenset({"shard-00000"}),
        capabilities=pb.Capabilities(),
        model_version=0,
        last_seen=last_seen,
    )


def test_silent_sessions_are_reaped_and_reported_lost():
    registry = WorkerRegistry()
    now = time.monotonic()
    quiet, chatty = _session("quiet", now - 31.0), _session("chatty", now - 2.0)
    registry.add(quiet)
    registry.add(chatty)
    while not registry.events.empty():
        registry.events.get_nowait()  # the two joins
    assert registry.reap_silent(30.0, now) == ["quiet"]
    assert not quiet.alive and chatty.alive
    assert [s.worker_id for s in registry.sessions()] == ["chatty"]
    event = registry.events.get_nowait()
    assert isinstance(event, WorkerLost) and "no heartbeat" in event.reason
    assert registry.reap_silent(30.0, now) == []  # reaped once
