"""The connected workers as the coordinator's step loop sees them: sessions, events, start-up reports.

A :class:`WorkerSession` is one worker's live ``Connect`` stream: what it holds (shards, the model
version it acknowledged, the version last sent to it) and an outbox the gRPC service streams
from. :class:`WorkerRegistry` keeps the live sessions by worker id (a new session of a worker
replaces the old one), the last start-up report of workers not yet connected, and one queue of
:data:`Event` values, written by the service's reader threads and read by the step loop
(:mod:`userdp.server.fleet`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto.results import TaskResult

_CLOSE = object()
"""Put in a session's outbox by :meth:`WorkerSession.close`: the stream ends there."""


# ---- events for the step loop ---------------------------------------------------------------


@dataclass(frozen=True)
class WorkerJoined:
    session: WorkerSession


@dataclass(frozen=True)
class WorkerLost:
    session: WorkerSession
    reason: str


@dataclass(frozen=True)
class ResultReceived:
    session: WorkerSession
    task_id: str
    attempt: int
    result: TaskResult | None
    error: str | None = None


@dataclass(frozen=True)
class TaskFailedEvent:
    session: WorkerSession
    task_id: str
    attempt: int
    reason: str


@dataclass(frozen=True)
class ModelAcked:
    session: WorkerSession
    model_version: int
    rejected: bool


@dataclass(frozen=True)
class GroupJoinedEvent:
    """A worker's answer to a ``GroupJoin`` (the collective data plane)."""

    session: WorkerSession
    generation: int
    ok: bool
    error: str


Event = WorkerJoined | WorkerLost | ResultReceived | TaskFailedEvent | ModelAcked | GroupJoinedEvent


# ---- sessions -------------------------------------------------------------------------------


@dataclass(eq=False)
class WorkerSession:
    worker_id: str
    session_id: str
    shards: frozenset[str]
    capabilities: pb.Capabilities
    model_version: int
    """The version the worker acknowledged holding (-1 while a resync is in flight)."""
    sent_version: int = -1
    """The last version sent to it (full or update); updates go only on top of this."""
    peer: str = ""
    alive: bool = True
    draining: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    outbox: queue.Queue = field(default_factory=queue.Queue)

    def send(self, message: pb.CoordinatorMessage) -> None:
        if self.alive:
            self.outbox.put(message)

    def send_many(self, messages: list[pb.CoordinatorMessage]) -> None:
        if self.alive:
            for message in messages:
                self.outbox.put(message)

    def close(self) -> None:
        self.alive = False
        self.outbox.put(_CLOSE)

    def outgoing(self) -> Iterator[pb.CoordinatorMessage]:
        """The messages to stream to the worker, in order, until the session is closed."""
        while True:
            message = self.outbox.get()
            if message is _CLOSE:
                return
            yield message


@dataclass(frozen=True)
class StartupStatus:
    """A starting worker's last progress report (``ReportStartup``)."""

    worker_id: str
    phase: str
    phase_seconds: float
    shards: frozenset[str]
    received: float
    """``time.monotonic()`` when the report arrived."""


class WorkerRegistry:
    """Live sessions by worker id, start-up reports of workers not yet connected, and the event
    queue the step loop reads."""

    def __init__(self) -> None:
        self.events: queue.Queue[Event] = queue.Queue()
        self._lock = threading.Lock()
        self._sessions: dict[str, WorkerSession] = {}
        self._startup: dict[str, StartupStatus] = {}

    def report_startup(self, status: StartupStatus) -> None:
        with self._lock:
            self._startup[status.worker_id] = status

    def startup(self) -> dict[str, StartupStatus]:
        """The last start-up report of every worker that sent one, by worker id."""
        with self._lock:
            return dict(self._startup)

    def add(self, session: WorkerSession) -> None:
        with self._lock:
            if not session.alive:  # its stream ended before it was registered
                return
            old = self._sessions.get(session.worker_id)
            self._sessions[session.worker_id] = session
        if old is not None:
            old.close()
            self.events.put(WorkerLost(old, "replaced by a new session of the same worker"))
        self.events.put(WorkerJoined(session))

    def lost(self, session: WorkerSession, reason: str) -> None:
        with self._lock:
            if self._sessions.get(session.worker_id) is session:
                del self._sessions[session.worker_id]
            elif not session.alive:
                return
        if session.alive:
            session.close()
            self.events.put(WorkerLost(session, reason))

    def sessions(self) -> list[WorkerSession]:
        with self._lock:
            return [s for s in self._sessions.values() if s.alive]

    def reap_silent(self, max_silence_s: float, now: float | None = None) -> list[str]:
        """Close every session that sent nothing (not even a heartbeat) for ``max_silence_s``:
        a hung worker becomes a lost one, whose tasks the step loop re-issues. Returns their ids."""
        now = time.monotonic() if now is None else now
        silent = [s for s in self.sessions() if now - s.last_seen > max_silence_s]
        for session in silent:
            self.lost(session, f"silent for {now - session.last_seen:.0f}s (no heartbeat)")
        return [s.worker_id for s in silent]

    def get(self, worker_id: str) -> WorkerSession | None:
        with self._lock:
            return self._sessions.get(worker_id)

    def close_all(self, reason: str = "coordinator shutting down") -> None:
        for session in self.sessions():
            session.send(pb.CoordinatorMessage(drain=pb.Drain(reason=reason)))
            session.close()
