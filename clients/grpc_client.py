"""The worker's gRPC side: connect, register, apply model versions, run tasks, stream partial sums.

:class:`WorkerClient` keeps one ``Connect`` stream to the coordinator and reconnects with
exponential backoff (with jitter) when it breaks; a refusal (UNAUTHENTICATED, PERMISSION_DENIED,
FAILED_PRECONDITION, INVALID_ARGUMENT) is final and raised as :class:`WorkerRefusedError`. The
reconnecting is bounded: once the coordinator has been unreachable (no session welcomed) for
``reconnect_timeout_s`` it raises :class:`CoordinatorUnreachableError` (0 = retry forever). A
``Drain`` from the coordinator (the run is over, or it lets the worker go) ends :meth:`run`
normally, without reconnecting.

Model versions: a full ``ModelCommit`` replaces every tensor; a non-full one (a step's update)
is applied only on top of the version just before it, and only when the tensors' sha256 matches
the commit. Otherwise the worker keeps its model and acknowledges the version it really has, so
the coordinator resyncs it with the full model instead of trusting it. A task for a model version
other than the worker's is refused (TaskFailed), never computed on the wrong model.

The gradient work is done by a :class:`TaskCompute` (the real one is
:class:`userdp.clients.worker_service.EngineCompute`); this module only moves bytes.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from userdp.clients.partial import ClippedSum
from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto import userdp_v1_pb2_grpc as pb_grpc
from userdp.proto.channels import (
    DEFAULT_MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    TlsFiles,
    bearer,
    channel_options,
    chunk_bytes_within,
)
from userdp.proto.tensors import (
    DEFAULT_CHUNK_BYTES,
    TensorAssembler,
    TensorDecodeError,
    WireTensor,
    tensors_chunks,
    tensors_sha256,
)

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
            f"coordinator {target} unreachable for {seconds:.0f}s; giving up (--reconnect-timeout)"
        )
        self.target = target
        self.seconds = seconds


DEFAULT_RECONNECT_TIMEOUT_S = 600.0


class TaskCompute(Protocol):
    """What a worker computes with: holds the model, applies versions, sums clipped units."""

    def apply_model(self, tensors: Mapping[str, WireTensor], full: bool) -> None: ...

    def compute(self, task: pb.Task) -> ClippedSum: ...


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
        from concurrent import futures

        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        from userdp.proto.channels import WORKER_HEALTH_SERVICE

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


class WorkerClient:
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
        self.target = target
        self.worker_id = worker_id
        self.shards = list(shards)
        self.compute = compute
        self.token = token
        self.tls = tls
        self.tls_server_name = tls_server_name
        self.capabilities = capabilities or pb.Capabilities(device="cpu", num_devices=1)
        self.manifest_sha256 = manifest_sha256
        self.max_message_bytes = max_message_bytes
        self.chunk_bytes = chunk_bytes_within(chunk_bytes, max_message_bytes)
        # result chunks of this session: also at most half of what the coordinator accepts
        # (its Welcome says), so a coordinator with a smaller limit never receives a message
        # over it
        self.session_chunk_bytes = self.chunk_bytes
        self.backoff = backoff
        self.reconnect_timeout_s = float(reconnect_timeout_s)
        self.heartbeat_s = heartbeat_s
        self.health = health
        self.on_welcome = on_welcome
        self.model_version = -1
        self.incarnation = ""  # the coordinator process that model_version came from
        self.sessions = 0
        self.tasks_done = 0
        self._model_lock = threading.Lock()
        self._stop = threading.Event()
        self._call: Any = None

    # ---- lifecycle ------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()
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
            self._call = pb_grpc.CoordinatorStub(channel).Connect(requests(), metadata=metadata)
            worker.start()
            model = _ModelReceiver()
            for message in self._call:
                kind = message.WhichOneof("kind")
                if kind == "welcome":
                    welcomed = True
                    self.session_chunk_bytes = chunk_bytes_within(
                        self.chunk_bytes, message.welcome.max_message_bytes
                    )
                    if message.welcome.incarnation != self.incarnation:
                        # a new coordinator process: our version number means nothing to it
                        self.incarnation = message.welcome.incarnation
                        with self._model_lock:
                            self.model_version = -1
                    self.sessions += 1
                    beat.start()
                    log.info("worker %s: connected to %s", self.worker_id, self.target)
                    if self.on_welcome is not None:
                        self.on_welcome()
                    self._set_ready(message.welcome.model_version)
                elif kind == "task":
                    tasks.put(message.task)
                elif kind == "cancel":
                    cancelled.add((message.cancel.task_id, message.cancel.attempt))
                elif kind == "model_part":
                    model.add(message.model_part)
                elif kind == "model_commit":
                    applied = self._apply(model, message.model_commit)
                    model = _ModelReceiver()
                    ack = pb.ModelAck(model_version=self.model_version, rejected=not applied)
                    outbox.put(pb.WorkerMessage(model_ack=ack))
                    self._set_ready(message.model_commit.model_version)
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

    def _set_ready(self, coordinator_version: int) -> None:
        if self.health is not None:
            self.health.set_ready(self.model_version == coordinator_version)

    def _heartbeats(self, outbox: queue.Queue, over: threading.Event) -> None:
        while not over.wait(self.heartbeat_s):
            outbox.put(pb.WorkerMessage(heartbeat=pb.Heartbeat(model_version=self.model_version)))

    # ---- model ----------------------------------------------------------------------------------

    def _apply(self, model: _ModelReceiver, commit: pb.ModelCommit) -> bool:
        """Apply a model version if it is consistent; return whether it was applied."""
        try:
            tensors = model.finish(commit)
        except TensorDecodeError as exc:
            log.warning(
                "worker %s: bad model version %d: %s", self.worker_id, commit.model_version, exc
            )
            return False
        if not commit.full and self.model_version != commit.model_version - 1:
            log.info(
                "worker %s: update %d does not follow held version %d; waiting for a resync",
                self.worker_id,
                commit.model_version,
                self.model_version,
            )
            return False
        with self._model_lock:
            self.compute.apply_model(tensors, commit.full)
            self.model_version = commit.model_version
        return True

    # ---- tasks ----------------------------------------------------------------------------------

    def _task_loop(self, tasks: queue.Queue, outbox: queue.Queue, cancelled: set) -> None:
        while True:
            task = tasks.get()
            if task is None:
                return
            if (task.task_id, task.attempt) in cancelled:
                continue
            started = time.perf_counter()
            with self._model_lock:
                if task.model_version != self.model_version:
                    reason = (
                        f"stale model: task wants {task.model_version}, have {self.model_version}"
                    )
                    outbox.put(_failed(task, reason))
                    continue
                try:
                    partial = self.compute.compute(task)
                except Exception as exc:  # report, never hang the coordinator's step
                    log.exception("worker %s: task %s failed", self.worker_id, task.task_id)
                    outbox.put(_failed(task, f"{type(exc).__name__}: {exc}"))
                    continue
            if (task.task_id, task.attempt) in cancelled:
                continue
            for chunk in tensors_chunks(partial.sums, self.session_chunk_bytes):
                outbox.put(
                    pb.WorkerMessage(
                        result_part=pb.ResultPart(
                            task_id=task.task_id, attempt=task.attempt, chunk=chunk
                        )
                    )
                )
            outbox.put(
                pb.WorkerMessage(
                    result=pb.Result(
                        task_id=task.task_id,
                        attempt=task.attempt,
                        step=task.step,
                        model_version=task.model_version,
                        num_tensors=len(partial.sums),
                        count=partial.count,
                        nonfinite=partial.nonfinite,
                        clipped=partial.clipped,
                        norms=pb.NormStats(
                            min=partial.norm_min,
                            max=partial.norm_max,
                            sum=partial.norm_sum,
                            sum_sq=partial.norm_sum_sq,
                        ),
                        loss_sum=partial.loss_sum,
                        tokens=partial.tokens,
                        compute_seconds=time.perf_counter() - started,
                        unit_ids=task.unit_ids,
                    )
                )
            )
            self.tasks_done += 1


class _ModelReceiver:
    """Collects one model version's chunks."""

    def __init__(self) -> None:
        self.assembler = TensorAssembler()
        self.version: int | None = None
        self.error: str | None = None

    def add(self, part: pb.ModelPart) -> None:
        if self.error:
            return
        if self.version is None:
            self.version = part.model_version
        elif part.model_version != self.version:
            self.error = f"model parts of versions {self.version} and {part.model_version} mixed"
            return
        try:
            self.assembler.add(part.chunk)
        except TensorDecodeError as exc:
            self.error = str(exc)

    def finish(self, commit: pb.ModelCommit) -> dict[str, WireTensor]:
        if self.error:
            raise TensorDecodeError(self.error)
        if self.version is not None and self.version != commit.model_version:
            raise TensorDecodeError(
                f"parts of version {self.version}, commit {commit.model_version}"
            )
        tensors = self.assembler.finish(expected_count=commit.num_tensors)
        if commit.params_sha256 and tensors_sha256(tensors) != commit.params_sha256:
            raise TensorDecodeError(f"model version {commit.model_version}: sha256 mismatch")
        return tensors


def _failed(task: pb.Task, reason: str) -> pb.WorkerMessage:
    return pb.WorkerMessage(
        task_failed=pb.TaskFailed(task_id=task.task_id, attempt=task.attempt, reason=reason)
    )
