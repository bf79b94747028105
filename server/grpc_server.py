"""Start the coordinator's gRPC server: the ``userdp.v1.Coordinator`` service plus standard
``grpc.health.v1`` health (service ``""`` and ``userdp.v1.Coordinator``), with explicit message
limits, and mTLS when TLS files are given. The service's requests are decoded by
:func:`~userdp.server.service.tolerant_deserializer`: a body that is not a valid protobuf message
is one warning line from the service, never a gRPC traceback."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from userdp.proto import userdp_v1_pb2_grpc as pb_grpc
from userdp.proto.channels import DEFAULT_MAX_MESSAGE_BYTES, SERVICE_NAME, TlsFiles, server_options
from userdp.proto.chunk_messages import decode_worker_message, serialize
from userdp.server.auth import Authorizer, server_credentials
from userdp.server.publisher import ModelPublisher
from userdp.server.registry import WorkerRegistry
from userdp.server.service import CoordinatorService, tolerant_deserializer


class ListenError(ValueError):
    """The server could not listen on ``host:port`` (the port is in use, or the host is not an
    address of this machine); :mod:`userdp.server.runtime` names the config key to change."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(f"coordinator: cannot listen on {host}:{port}")
        self.host = host
        self.port = port


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    service: CoordinatorService
    health: health.HealthServicer

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, grace: float | None = None, drain_workers: bool = False) -> None:
        """Stop serving. ``drain_workers``: tell workers to exit (the run is over); otherwise
        they keep reconnecting with backoff (a restarted coordinator picks them up again)."""
        self.health.enter_graceful_shutdown()
        if drain_workers:
            self.service.registry.close_all()
        else:
            for session in self.service.registry.sessions():
                session.close()
        self.server.stop(grace).wait()


class _Registrations:
    """Records the method handlers a generated ``add_*Servicer_to_server`` function registers."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # the same handlers also come through add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers) -> None:
        self.services[service] = dict(handlers)


def add_coordinator_service(service: CoordinatorService, server: grpc.Server) -> None:
    """Register ``service`` as the generated code does, with every request deserializer made
    tolerant (:func:`~userdp.server.service.tolerant_deserializer`) and the session stream's
    chunk envelopes read and written by :mod:`userdp.proto.chunk_messages`."""
    registrations = _Registrations()
    pb_grpc.add_CoordinatorServicer_to_server(service, registrations)
    if not registrations.services:
        raise RuntimeError("the generated userdp.v1 code registered no method handlers")
    for name, handlers in registrations.services.items():
        tolerant = {
            method: handler._replace(
                request_deserializer=tolerant_deserializer(handler.request_deserializer)
            )
            if handler.request_deserializer is not None
            else handler
            for method, handler in handlers.items()
        }
        if "Connect" in tolerant:  # the session stream: chunk envelopes without protobuf copies
            tolerant["Connect"] = tolerant["Connect"]._replace(
                request_deserializer=tolerant_deserializer(decode_worker_message),
                response_serializer=serialize,
            )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, tolerant),))
        server.add_registered_method_handlers(name, tolerant)


def serve(
    registry: WorkerRegistry,
    publisher: ModelPublisher,
    authorizer: Authorizer,
    shard_sha256: Mapping[str, str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    tls: TlsFiles | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_partial_bytes: int = 1 << 34,
    max_workers: int = 256,
    manifest_sha256: str = "",
) -> RunningServer:
    """Start serving on ``host:port`` (0 = a free port); each worker stream holds one thread."""
    if tls is None and authorizer.mtls:
        raise ValueError("mTLS authorization needs TLS files (--tls-dir)")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="userdp-rpc"),
        options=server_options(max_message_bytes),
        maximum_concurrent_rpcs=max_workers - 4,
    )
    service = CoordinatorService(
        registry,
        publisher,
        authorizer,
        shard_sha256,
        max_partial_bytes=max_partial_bytes,
        max_message_bytes=max_message_bytes,
        manifest_sha256=manifest_sha256,
    )
    add_coordinator_service(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{host}:{port}"
    try:
        bound = (
            server.add_secure_port(address, server_credentials(tls))
            if tls is not None
            else server.add_insecure_port(address)
        )
    except RuntimeError:  # "Failed to bind to address" (older gRPC returned 0)
        bound = 0
    if bound == 0:
        raise ListenError(host, port)
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, bound, service, health_servicer)
