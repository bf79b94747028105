"""The coordinator's gRPC servicer: one session per connected worker, events for the step loop.

``CoordinatorService.Connect`` authenticates the caller, reads the worker's ``Register``, checks it
(protocol version, identity, shards against the manifest's sha256), answers ``Welcome`` and then
streams whatever the step loop puts in the session's outbox — first the full model when the
worker's version is not the current one (a stale worker is resynced, never trusted). A reader
thread per session turns the worker's messages into events (:mod:`userdp.server.registry`) on
one queue, which the step loop (:mod:`userdp.server.fleet`) consumes. Partial sums are
reassembled here (:class:`~userdp.proto.tensors.TensorAssembler`, bounded by the model's size),
decoded by :func:`~userdp.proto.codec.result_from_proto` and judged there.

Request bodies are decoded by :func:`tolerant_deserializer` (the server registers it,
:mod:`userdp.server.grpc_server`): a body that is not a valid protobuf message reaches the handler
as :class:`Undecodable`, which logs one warning line (peer, method, why) and refuses the call
with INVALID_ARGUMENT, or ends the session when it arrives inside a ``Connect`` stream.

The sessions and the registry (:mod:`userdp.server.registry`) and the model publisher
(:mod:`userdp.server.publisher`) the servicer works with are importable from here too.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto import userdp_v1_pb2_grpc as pb_grpc
from userdp.proto.channels import PROTOCOL_VERSION
from userdp.proto.codec import result_from_proto
from userdp.proto.tensors import TensorAssembler, TensorDecodeError
from userdp.server.auth import Authorizer
from userdp.server.publisher import ModelPublisher
from userdp.server.registry import (
    GroupJoinedEvent,
    ModelAcked,
    ResultReceived,
    StartupStatus,
    TaskFailedEvent,
    WorkerRegistry,
    WorkerSession,
)

__all__ = [
    "CoordinatorService",
    "ModelPublisher",
    "StartupStatus",
    "Undecodable",
    "WorkerRegistry",
    "WorkerSession",
    "tolerant_deserializer",
]

log = logging.getLogger(__name__)

MAX_OPEN_RESULTS = 8
"""Partial sums one session may be receiving at once (bounds coordinator memory)."""
CHUNK_MESSAGE_OVERHEAD = 64 << 10
"""A chunk message's framing, name and shape, generously."""


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


# ---- the service ----------------------------------------------------------------------------


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
        manifest_sha256: str = "",
    ) -> None:
        self.registry = registry
        self.publisher = publisher
        self.authorizer = authorizer
        self.shard_sha256 = dict(shard_sha256)
        self.manifest_sha256 = manifest_sha256
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
        yield from session.outgoing()

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
        """A worker must hold the coordinator's shard set: the same ``manifest.json`` (when both
        sides know its sha256) and, for each shard it holds, the manifest's sha256."""
        theirs, ours = reg.shard_manifest_sha256, self.manifest_sha256
        if theirs and ours and theirs != ours:
            return (
                f"worker {reg.worker_id} holds a different shard set: its manifest.json sha256 "
                f"{theirs[:12]}... != the coordinator's {ours[:12]}...; give the worker the "
                "coordinator's data.shards folder (the same `userdp shard` output)"
            )
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
                elif kind == "group_joined":
                    j = message.group_joined
                    events.put(GroupJoinedEvent(session, j.generation, j.ok, j.error))
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
        return ResultReceived(session, *key, result_from_proto(result, session.worker_id, tensors))
