"""The worker's connection to the coordinator: connect, register, reconnect, heartbeat, drain.

:class:`WorkerClient` keeps one ``Connect`` stream to the coordinator and reconnects with
exponential backoff (with jitter) when it breaks; a refusal (UNAUTHENTICATED, PERMISSION_DENIED,
FAILED_PRECONDITION, INVALID_ARGUMENT) is final and raised as :class:`WorkerRefusedError`. The
reconnecting is bounded: once the coordinator has been unreachable (no session welcomed) for
``reconnect_timeout_s`` it raises :class:`CoordinatorUnreachableError` (0 = retry forever). A
``Drain`` from the coordinator (the run is over, or it lets the worker go) ends :meth:`run`
normally, without reconnecting. While a session is welcomed the worker heartbeats every
``heartbeat_s``; :class:`WorkerHealth` tells Kubernetes whether it is connected and in sync.

What the stream carries is handled by :class:`~userdp.clients.task_runner.TaskRunner`, which
the client extends: model versions (applied only when consistent; otherwise the worker
acknowledges the version it really has and is resynced) and tasks (refused when they are for
another model version). The gradient work is done by a
:class:`~userdp.clients.task_runner.TaskCompute` (the real one is
:class:`userdp.clients.worker_service.EngineCompute`); this module only moves bytes.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from userdp.clients.group_plane import WorkerGroup
from userdp.clients.task_runner import ModelReceiver, TaskCompute, TaskRunner
from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto.channels import (
    DEFAULT_MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    WORKER_HEALTH_SERVICE,
    TlsFiles,
    bearer,
    channel_options,
    chunk_bytes_within,
)
from userdp.proto.chunk_messages import connect
from userdp.proto.tensors import DEFAULT_CHUNK_BYTES

__all__ = [
    "Backoff",
    "CoordinatorUnreachableError",
    "TaskCompute",
    "WorkerClient",
    "WorkerHealth",
    "WorkerRefusedError",
    "worker_channel",
]

log = logging.getLogger(__name__)

FATAL_CODES = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
    }
)


class WorkerRefusedError(RuntimeError):
    """The coordinator refused this worker (bad token/certificate, unknown id, wrong shards)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"coordinator refused the worker: {code.name}: {details}")
        self.code = code
        self.details = details


class CoordinatorUnreachableError(RuntimeError):
    """No session with the coordinator was welcomed for ``reconnect_timeout_s`` seconds."""

    def __init__(self, target: str, seconds: float) -> None:
        super().__init__(
            f"coordinator {target} unreachable for {seconds:.0f}s; giving up (set "
            "workers.reconnect_timeout_s or --reconnect-timeout to wait longer)"
        )
        self.target = target
        self.seconds = seconds


DEFAULT_RECONNECT_TIMEOUT_S = 600.0
GROUP_CLOSE_WAIT_S = 10.0
"""How long :meth:`WorkerClient.run` waits, as it returns, for the collective plane's thread to
leave gloo (its join or collective fails at once when a peer died; one with live peers may
take until the group's timeout, and is then left behind)."""


@dataclass(frozen=True)
class Backoff:
    initial_s: float = 0.5
    max_s: float = 30.0
    factor: float = 2.0
    jitter: float = 0.2

    def delays(self):
        delay = self.initial_s
        while True:
            yield delay * (1 + random.uniform(-self.jitter, self.jitter))
            delay = min(delay * self.factor, self.max_s)


class WorkerHealth:
    """A grpc.health.v1 endpoint for the worker process (Kubernetes probes).

    Service ``""`` is SERVING while the process runs (liveness); ``userdp.v1.Worker`` is SERVING
    only while the worker is connected and holds the coordinator's model (readiness)."""

    def __init__(self, port: int, host: str = "0.0.0.0") -> None:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        self._pb = health_pb2
        self._name = WORKER_HEALTH_SERVICE
        self.servicer = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        self.servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        self.set_ready(False)
        self.server.start()

    def set_ready(self, ready: bool) -> None:
        status = self._pb.HealthCheckResponse
        self.servicer.set(self._name, status.SERVING if ready else status.NOT_SERVING)

    def stop(self) -> None:
        self.server.stop(grace=None)


def worker_channel(
    target: str,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    tls: TlsFiles | None = None,
    tls_server_name: str = "coordinator",
) -> grpc.Channel:
    """A channel to the coordinator: mTLS with the worker's certificate when ``tls`` is given."""
    options = channel_options(max_message_bytes)
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
    )
    options.append(("grpc.ssl_target_name_override", tls_server_name))
    return grpc.secure_channel(target, credentials, options=options)


class WorkerClient(TaskRunner):
    """One worker's connection loop (see the module docstring)."""

    def __init__(
        self,
        target: str,
        worker_id: str,
        shards: Sequence[tuple[str, str]],
        compute: TaskCompute,
        *,
        token: str | None = None,
        tls: TlsFiles | None = None,
        tls_server_name: str = "coordinator",
        capabilities: pb.Capabilities | None = None,
        manifest_sha256: str = "",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        backoff: Backoff = Backoff(),
        reconnect_timeout_s: float = DEFAULT_RECONNECT_TIMEOUT_S,
        heartbeat_s: float = 5.0,
        health: WorkerHealth | None = None,
        on_welcome: Callable[[], None] | None = None,
    ) -> None:
        """``reconnect_timeout_s``: how long the coordinator may stay unreachable (no session
        welcomed) before :meth:`run` raises :class:`CoordinatorUnreachableError`; 0 = forever."""
        if reconnect_timeout_s < 0:
            raise ValueError(f"reconnect timeout must be >= 0 s, got {reconnect_timeout_s:g}")
        self.chunk_bytes = chunk_bytes_within(chunk_bytes, max_message_bytes)
        # result chunks of this session: also at most half of what the coordinator accepts
        # (its Welcome says), so a coordinator with a smaller limit never receives a message
        # over it
        super().__init__(worker_id, compute, session_chunk_bytes=self.chunk_bytes)
        self.target = target
        self.shards = list(shards)
        self.token = token
        self.tls = tls
        self.tls_server_name = tls_server_name
        self.capabilities = capabilities or pb.Capabilities(device="cpu", num_devices=1)
        self.manifest_sha256 = manifest_sha256
        self.max_message_bytes = max_message_bytes
        self.backoff = backoff
        self.reconnect_timeout_s = float(reconnect_timeout_s)
        self.heartbeat_s = heartbeat_s
        self.health = health
        self.on_welcome = on_welcome
        self.incarnation = ""  # the coordinator process that model_version came from
        self.sessions = 0
        self._stop = threading.Event()
        self._call: Any = None
        self._group: WorkerGroup | None = None

    # ---- lifecycle ------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()
        if self._group is not None:
            self._group.close()
        call = self._call
        if call is not None:
            call.cancel()

    def drain(self, timeout_s: float = 60.0) -> None:
        """Graceful shutdown (SIGTERM): tell the coordinator to send no more tasks, finish the
        queued ones (bounded by ``timeout_s``), then stop. Unfinished tasks are re-issued by the
        coordinator when the stream closes."""
        outbox = getattr(self, "_outbox", None)
        if outbox is not None:
            outbox.put(pb.WorkerMessage(drain=pb.DrainRequest(reason="worker shutting down")))
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and (
                not self._tasks.empty() or self._model_lock.locked()
            ):
                time.sleep(0.05)
        self.stop()

    def run(self) -> None:
        """Serve until :meth:`stop` or a Drain; reconnect with backoff on stream errors, for at
        most ``reconnect_timeout_s`` without a welcomed session (then
        :class:`CoordinatorUnreachableError`). Raises :class:`WorkerRefusedError` on a refusal."""
        try:
            self._reconnect()
        finally:
            if self._group is not None:  # the process may exit next: leave gloo first
                self._group.close(wait_s=GROUP_CLOSE_WAIT_S)

    def _reconnect(self) -> None:
        delays = self.backoff.delays()
        last_contact = time.monotonic()  # start, or the end of the last welcomed session
        while not self._stop.is_set():
            welcomed = self._session()
            if self.health is not None:
                self.health.set_ready(False)
            if welcomed:
                delays = self.backoff.delays()
                last_contact = time.monotonic()
            if self._stop.is_set():
                return
            delay = next(delays)
            if self.reconnect_timeout_s > 0:
                unreachable = time.monotonic() - last_contact
                if unreachable >= self.reconnect_timeout_s:
                    raise CoordinatorUnreachableError(self.target, unreachable)
                delay = min(delay, self.reconnect_timeout_s - unreachable)
            log.info("worker %s: reconnecting in %.1fs", self.worker_id, delay)
            self._stop.wait(delay)

    def _channel(self) -> grpc.Channel:
        return worker_channel(self.target, self.max_message_bytes, self.tls, self.tls_server_name)

    def _capabilities(self) -> pb.Capabilities:
        """The configured capabilities plus this worker's receive limit (the coordinator refuses
        a worker that could not receive its model chunks)."""
        capabilities = pb.Capabilities()
        capabilities.CopyFrom(self.capabilities)
        capabilities.max_message_bytes = self.max_message_bytes
        capabilities.collective_plane = True
        return capabilities

    def _register(self) -> pb.WorkerMessage:
        return pb.WorkerMessage(
            register=pb.Register(
                worker_id=self.worker_id,
                protocol_version=PROTOCOL_VERSION,
                shards=[pb.ShardHolding(name=n, sha256=h) for n, h in self.shards],
                capabilities=self._capabilities(),
                model_version=self.model_version,
                shard_manifest_sha256=self.manifest_sha256,
                incarnation=self.incarnation,
            )
        )

    def _session(self) -> bool:
        """One stream; returns whether it got as far as Welcome. Raises WorkerRefusedError."""
        outbox: queue.Queue = queue.Queue()
        tasks: queue.Queue = queue.Queue()
        self._outbox, self._tasks = outbox, tasks
        cancelled: set[tuple[str, int]] = set()
        outbox.put(self._register())
        session_over = threading.Event()

        def requests():
            while True:
                message = outbox.get()
                if message is None:
                    return
                yield message

        channel = self._channel()
        welcomed = False
        metadata = bearer(self.token) if self.token else None
        worker = threading.Thread(
            target=self._task_loop, args=(tasks, outbox, cancelled), daemon=True
        )
        beat = threading.Thread(target=self._heartbeats, args=(outbox, session_over), daemon=True)
        try:
            self._call = connect(channel)(requests(), metadata=metadata)
            worker.start()
            model = ModelReceiver()
            for message in self._call:
                kind = message.WhichOneof("kind")
                if kind == "welcome":
                    welcomed = True
                    self._on_welcome(message.welcome, beat)
                elif kind == "task":
                    tasks.put(message.task)
                elif kind == "cancel":
                    cancelled.add((message.cancel.task_id, message.cancel.attempt))
                elif kind == "model_part":
                    model.add(message.model_part)
                elif kind == "model_commit":
                    self._on_model_commit(model, message.model_commit, outbox)
                    model = ModelReceiver()
                elif kind in ("group_join", "group_reduce", "group_model"):
                    self._group_message(kind, getattr(message, kind), outbox)
                elif kind == "drain":
                    log.info(
                        "worker %s: drained by coordinator (%s)",
                        self.worker_id,
                        message.drain.reason,
                    )
                    self._stop.set()
                    break
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code in FATAL_CODES:
                raise WorkerRefusedError(code, exc.details()) from None
            if not self._stop.is_set():
                log.warning("worker %s: stream broke: %s", self.worker_id, code)
        finally:
            session_over.set()
            tasks.put(None)
            outbox.put(None)
            if worker.is_alive():
                worker.join(timeout=5)
            self._call = None
            channel.close()
        return welcomed

    def _on_welcome(self, welcome: Any, beat: threading.Thread) -> None:
        """A session's Welcome: its chunk size, a new coordinator's incarnation (our model
        version means nothing to it), the heartbeats, and readiness at its model version."""
        self.session_chunk_bytes = chunk_bytes_within(self.chunk_bytes, welcome.max_message_bytes)
        if welcome.incarnation != self.incarnation:
            self.incarnation = welcome.incarnation
            with self._model_lock:
                self.model_version = -1
            if self._group is not None:
                self._group.forget_sources()
        self.sessions += 1
        beat.start()
        log.info("worker %s: connected to %s", self.worker_id, self.target)
        if self.on_welcome is not None:
            self.on_welcome()
        self._set_ready(welcome.model_version)

    def _on_model_commit(self, model: ModelReceiver, commit: Any, outbox: queue.Queue) -> None:
        """A received model version: applied (or rejected), acknowledged, passed to the group."""
        tensors = self._receive_version(model, commit)
        ack = pb.ModelAck(model_version=self.model_version, rejected=tensors is None)
        outbox.put(pb.WorkerMessage(model_ack=ack))
        self._set_ready(commit.model_version)
        if self._group is not None:
            self._group.source_applied(commit.model_version, tensors)

    def _group_message(self, kind: str, message: Any, outbox: queue.Queue) -> None:
        """The collective data plane's messages (:mod:`userdp.clients.group_plane`)."""
        if self._group is None:
            host = self.target.removeprefix("dns:///").rsplit(":", 1)[0].strip("[]")
            self._group = WorkerGroup(self, host, on_version=self._set_ready)
        if kind == "group_join":
            self._group.join(message, outbox.put)
        elif kind == "group_reduce":
            self._group.reduce(message, outbox.put)
        else:
            self._group.model(message, outbox.put)

    def _set_ready(self, coordinator_version: int) -> None:
        if self.health is not None:
            self.health.set_ready(self.model_version == coordinator_version)

    def _heartbeats(self, outbox: queue.Queue, over: threading.Event) -> None:
        while not over.wait(self.heartbeat_s):
            outbox.put(pb.WorkerMessage(heartbeat=pb.Heartbeat(model_version=self.model_version)))
