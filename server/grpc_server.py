"""Start the coordinator's gRPC server: the ``userdp.v1.Coordinator`` service plus standard
``grpc.health.v1`` health (service ``""`` and ``userdp.v1.Coordinator``), with explicit message
limits, and mTLS when TLS files are given."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from userdp.proto import userdp_v1_pb2_grpc as pb_grpc
from userdp.proto.channels import DEFAULT_MAX_MESSAGE_BYTES, SERVICE_NAME, TlsFiles, server_options
from userdp.server.auth import Authorizer, server_credentials
from userdp.server.service import CoordinatorService, ModelPublisher, WorkerRegistry


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
    )
    pb_grpc.add_CoordinatorServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{host}:{port}"
    bound = (
        server.add_secure_port(address, server_credentials(tls))
        if tls is not None
        else server.add_insecure_port(address)
    )
    if bound == 0:
        raise ValueError(f"coordinator: cannot listen on {address} (port in use or bad host)")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, bound, service, health_servicer)
