"""The coordinator's gRPC side: one session per connected worker, events for the step loop.

``CoordinatorService.Connect`` authenticates the caller, reads the worker's ``Register``, checks it
(protocol version, identity, shards against the manifest's sha256), answers ``Welcome`` and then
streams whatever the step loop puts in the session's outbox — first the full model when the
worker's version is not the current one (a stale worker is resynced, never trusted). A reader
thread per session turns the worker's messages into :class:`Event` values on one queue, which the
step loop (:mod:`userdp.server.coordinator`) consumes. Partial sums are reassembled here
(:class:`~userdp.proto.tensors.TensorAssembler`, bounded by the model's size) and judged there.

Request bodies are decoded by :func:`tolerant_deserializer` (the server registers it,
:mod:`userdp.server.grpc_server`): a body that is not a valid protobuf message reaches the handler
as :class:`Undecodable`, which logs one warning line (peer, method, why) and refuses the call
with INVALID_ARGUMENT, or ends the session when it arrives inside a ``Connect`` stream.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto import userdp_v1_pb2_grpc as pb_grpc
from userdp.proto.channels import PROTOCOL_VERSION
from userdp.proto.tensors import (
    TensorAssembler,
    TensorDecodeError,
    chunks_sha256,
    tensors_chunks,
)
from userdp.server.aggregation import PartialSum
from userdp.server.auth import Authorizer

log = logging.getLogger(__name__)

_CLOSE = object()
MAX_OPEN_RESULTS = 8
CHUNK_MESSAGE_OVERHEAD = 64 << 10  # a chunk message's framing, name and shape, generously
"""Partial sums one session may be receiving at once (bounds coordinator memory)."""


# ---- undecodable requests -------------------------------------------------------------------


@dataclass(frozen=True)
class Undecodable:
    """A request body that is not a valid message of the method's protobuf type."""

    size: int
    """Its length in bytes."""
    error: str
    """Why it does not decode (the protobuf library's message, on one line)."""


def tolerant_deserializer(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``deserializer`` returning :class:`Undecodable` instead of raising, so the handler reports
    the bad body in one line instead of gRPC logging a traceback."""

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf's DecodeError, or any other decoding failure
            return Undecodable(len(data), " ".join(str(exc).split()) or type(exc).__name__)

    return deserialize


def _log_undecodable(method: str, peer: str, request: Undecodable, worker: str = "") -> None:
    who = f"worker {worker} ({peer})" if worker else peer
    log.warning(
        "undecodable %s message from %s: %s (%d bytes)", method, who, request.error, request.size
    )


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
    partial: PartialSum | None
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


Event = WorkerJoined | WorkerLost | ResultReceived | TaskFailedEvent | ModelAcked


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


class ModelPublisher:
    """The current model version in wire form. :meth:`publish` encodes a step's update (the
    trainable tensors, chunked once, shared by every session); :meth:`full` adds the frozen
    tensors for a resync. Updates carry no sha256 (transport integrity is TCP/HTTP2/TLS and the
    chunk checks); a full model carries one, which the worker verifies before applying it."""

    def __init__(self, chunk_bytes: int = 1 << 20) -> None:
        self.chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self.version = -1
        self._trainable_parts: list[pb.CoordinatorMessage] = []
        self._trainable_count = 0
        self._frozen_chunks: list[pb.TensorChunk] = []
        self._frozen_count = 0
        self._full_cache: tuple[int, list[pb.CoordinatorMessage]] | None = None

    def _parts(
        self,
        version: int,
        tensors: Mapping[str, torch.Tensor],
        sink: Callable[[pb.CoordinatorMessage], None] | None = None,
    ) -> list:
        out: list[pb.CoordinatorMessage] = []

        def new_chunk() -> pb.TensorChunk:
            message = pb.CoordinatorMessage()
            message.model_part.model_version = version
            out.append(message)
            return message.model_part.chunk

        for _ in tensors_chunks(tensors, self.chunk_bytes, new_chunk):
            if sink is not None:
                sink(out[-1])  # complete: stream it while the next chunk is encoded
        return out

    def publish(
        self,
        version: int,
        trainable: Mapping[str, torch.Tensor],
        frozen: Mapping[str, torch.Tensor] | None = None,
        sink: Callable[[pb.CoordinatorMessage], None] | None = None,
    ) -> list[pb.CoordinatorMessage]:
        """Encode ``trainable`` (and ``frozen`` when given) as ``version``; return the update
        messages (trainable tensors + a non-full commit) to send to in-sync workers. ``sink``
        receives each message as soon as it is encoded (the commit included), so sending
        overlaps encoding."""
        parts = self._parts(version, trainable, sink)
        frozen_chunks = (
            list(tensors_chunks(frozen, self.chunk_bytes)) if frozen is not None else None
        )
        with self._lock:
            self.version = version
            self._trainable_parts, self._trainable_count = parts, len(trainable)
            if frozen_chunks is not None:
                self._frozen_chunks, self._frozen_count = frozen_chunks, len(frozen)
            self._full_cache = None
        commit = pb.CoordinatorMessage(
            model_commit=pb.ModelCommit(
                model_version=version, full=False, num_tensors=len(trainable)
            )
        )
        if sink is not None:
            sink(commit)
        return [*parts, commit]

    def full(self) -> tuple[int, list[pb.CoordinatorMessage]]:
        """(version, every tensor + a full commit with the model's sha256) for a resync."""
        with self._lock:
            if self._full_cache is None or self._full_cache[0] != self.version:
                frozen_parts = []
                for chunk in self._frozen_chunks:
                    message = pb.CoordinatorMessage()
                    message.model_part.model_version = self.version
                    message.model_part.chunk.CopyFrom(chunk)
                    frozen_parts.append(message)
                parts = [*frozen_parts, *self._trainable_parts]
                commit = pb.ModelCommit(
                    model_version=self.version,
                    full=True,
                    num_tensors=self._frozen_count + self._trainable_count,
                    params_sha256=chunks_sha256(m.model_part.chunk for m in parts),
                )
                self._full_cache = (
                    self.version,
                    [*parts, pb.CoordinatorMessage(model_commit=commit)],
                )
            return self._full_cache


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


class CoordinatorService(pb_grpc.CoordinatorServicer):
    """The ``userdp.v1.Coordinator`` service (see the module docstring)."""

    def __init__(
        self,
        registry: WorkerRegistry,
        publisher: ModelPublisher,
        authorizer: Authorizer,
        shard_sha256: Mapping[str, str],
        max_partial_bytes: int,
        max_message_bytes: int,
        heartbeat_interval_s: float = 5.0,
    ) -> None:
        self.registry = registry
        self.publisher = publisher
        self.authorizer = authorizer
        self.shard_sha256 = dict(shard_sha256)
        self.max_partial_bytes = max_partial_bytes
        self.max_message_bytes = max_message_bytes
        self.heartbeat_interval_s = heartbeat_interval_s
        self.incarnation = uuid.uuid4().hex

    def ReportStartup(self, request, context):  # noqa: N802 - gRPC method name
        identity = self.authorizer.authenticate(context)
        if isinstance(request, Undecodable):
            _log_undecodable("ReportStartup", context.peer(), request)
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request is not a userdp.v1.StartupReport: {request.error}",
            )
        if not request.worker_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "StartupReport.worker_id is empty")
        self.authorizer.authorize(context, identity, request.worker_id)
        self.registry.report_startup(
            StartupStatus(
                worker_id=request.worker_id,
                phase=request.phase,
                phase_seconds=request.phase_seconds,
                shards=frozenset(request.shards),
                received=time.monotonic(),
            )
        )
        return pb.StartupAck()

    def Connect(self, request_iterator, context):  # noqa: N802 - gRPC method name
        identity = self.authorizer.authenticate(context)
        try:
            first = next(request_iterator)
        except (StopIteration, grpc.RpcError):
            return
        if isinstance(first, Undecodable):
            _log_undecodable("Connect", context.peer(), first)
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the first message is not a userdp.v1.WorkerMessage: {first.error}",
            )
        if first.WhichOneof("kind") != "register":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be Register")
        reg = first.register
        if not reg.worker_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Register.worker_id is empty")
        self.authorizer.authorize(context, identity, reg.worker_id)
        if reg.protocol_version != PROTOCOL_VERSION:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker speaks protocol {reg.protocol_version}, coordinator {PROTOCOL_VERSION}",
            )
        problem = self._check_shards(reg) or self._check_message_limit(reg)
        if problem:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        session = WorkerSession(
            worker_id=reg.worker_id,
            session_id=uuid.uuid4().hex,
            shards=frozenset(s.name for s in reg.shards),
            capabilities=reg.capabilities,
            model_version=reg.model_version,
            peer=context.peer(),
        )
        version = self.publisher.version
        # A version number means something only within one coordinator incarnation.
        resync = reg.model_version != version or reg.incarnation != self.incarnation
        if resync:
            session.model_version = -1  # not trusted until it acks the full model
        else:
            session.sent_version = version
        session.send(
            pb.CoordinatorMessage(
                welcome=pb.Welcome(
                    session_id=session.session_id,
                    model_version=version,
                    resync=resync,
                    max_message_bytes=self.max_message_bytes,
                    heartbeat_interval_s=self.heartbeat_interval_s,
                    incarnation=self.incarnation,
                )
            )
        )
        context.add_callback(lambda: self.registry.lost(session, "stream ended"))
        self.registry.add(session)
        log.info(
            "worker %s joined (%s), shards %s",
            reg.worker_id,
            context.peer(),
            sorted(session.shards),
        )
        threading.Thread(
            target=self._read,
            args=(session, request_iterator),
            daemon=True,
            name=f"userdp-read-{reg.worker_id}",
        ).start()
        while True:
            message = session.outbox.get()
            if message is _CLOSE:
                return
            yield message

    def _check_message_limit(self, reg: pb.Register) -> str | None:
        """A worker that could not receive the model's chunks would fail on every broadcast and
        reconnect forever: refuse it at once, saying which limit to raise. 0 = not stated (an
        older worker): accepted."""
        limit = reg.capabilities.max_message_bytes
        needed = self.publisher.chunk_bytes + CHUNK_MESSAGE_OVERHEAD
        if limit and limit < needed:
            return (
                f"worker {reg.worker_id!r} accepts messages of at most {limit} bytes, but the "
                f"coordinator sends model chunks of up to {needed} bytes: raise the worker's "
                "--max-message-mb (coordinator.max_message_mb sets the coordinator's chunk size)"
            )
        return None

    def _check_shards(self, reg: pb.Register) -> str | None:
        for holding in reg.shards:
            expected = self.shard_sha256.get(holding.name)
            if expected is None:
                return f"worker {reg.worker_id} holds shard {holding.name!r}, not in the manifest"
            if holding.sha256 != expected:
                return (
                    f"worker {reg.worker_id}: shard {holding.name} sha256 {holding.sha256[:12]}... "
                    f"!= manifest {expected[:12]}... (different or corrupt data)"
                )
        return None

    def _read(self, session: WorkerSession, request_iterator) -> None:
        assemblers: dict[tuple[str, int], TensorAssembler] = {}
        broken: dict[tuple[str, int], str] = {}
        events = self.registry.events
        reason = "stream ended"
        try:
            for message in request_iterator:
                session.last_seen = time.monotonic()
                if isinstance(message, Undecodable):
                    _log_undecodable("Connect", session.peer, message, session.worker_id)
                    reason = f"protocol error: undecodable message ({message.error})"
                    break
                kind = message.WhichOneof("kind")
                if kind == "result_part":
                    part = message.result_part
                    key = (part.task_id, part.attempt)
                    if key in broken:
                        continue
                    assembler = assemblers.get(key)
                    if assembler is None:
                        if len(assemblers) >= MAX_OPEN_RESULTS:
                            broken[key] = f"more than {MAX_OPEN_RESULTS} partials in flight"
                            continue
                        assembler = assemblers[key] = TensorAssembler(self.max_partial_bytes)
                    try:
                        assembler.add(part.chunk)
                    except TensorDecodeError as exc:
                        broken[key] = str(exc)
                        del assemblers[key]
                elif kind == "result":
                    events.put(self._result_event(session, message.result, assemblers, broken))
                elif kind == "task_failed":
                    f = message.task_failed
                    assemblers.pop((f.task_id, f.attempt), None)
                    events.put(TaskFailedEvent(session, f.task_id, f.attempt, f.reason))
                elif kind == "model_ack":
                    ack = message.model_ack
                    session.model_version = -1 if ack.rejected else ack.model_version
                    events.put(ModelAcked(session, ack.model_version, ack.rejected))
                elif kind == "drain":
                    session.draining = True
                    reason = f"drained: {message.drain.reason}"
                elif kind == "heartbeat":
                    pass
                else:
                    reason = f"protocol error: unexpected {kind}"
                    break
        except grpc.RpcError as exc:
            reason = f"stream error: {exc.code() if hasattr(exc, 'code') else exc}"
        except Exception as exc:  # a reader must never die silently
            log.exception("reader for %s failed", session.worker_id)
            reason = f"reader error: {exc}"
        self.registry.lost(session, reason)

    def _result_event(
        self,
        session: WorkerSession,
        result: pb.Result,
        assemblers: dict[tuple[str, int], TensorAssembler],
        broken: dict[tuple[str, int], str],
    ) -> ResultReceived:
        key = (result.task_id, result.attempt)
        if key in broken:
            return ResultReceived(session, *key, None, broken.pop(key))
        assembler = assemblers.pop(key, None) or TensorAssembler(self.max_partial_bytes)
        try:
            tensors = assembler.finish(expected_count=result.num_tensors)
        except TensorDecodeError as exc:
            return ResultReceived(session, *key, None, str(exc))
        partial = PartialSum(
            task_id=result.task_id,
            attempt=result.attempt,
            step=result.step,
            model_version=result.model_version,
            worker_id=session.worker_id,
            unit_ids=tuple(result.unit_ids),
            tensors=tensors,
            count=result.count,
            nonfinite=result.nonfinite,
            clipped=result.clipped,
            norm_min=result.norms.min,
            norm_max=result.norms.max,
            norm_sum=result.norms.sum,
            norm_sum_sq=result.norms.sum_sq,
            loss_sum=result.loss_sum,
            tokens=result.tokens,
            compute_seconds=result.compute_seconds,
        )
        return ResultReceived(session, *key, partial)
