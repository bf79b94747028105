"""A grpc.health.v1 check: whether a service is SERVING. The chart's coordinator probes use it
(with mTLS the kubelet's native gRPC probe cannot present a client certificate), and so does the
image's HEALTHCHECK."""

from __future__ import annotations

import grpc

from userdp.kubernetes.chart import (
    COORDINATOR_CERT_NAME,
)
from userdp.proto.channels import read_tls_files


def probe(
    address: str,
    service: str = "",
    *,
    tls_dir: str | None = None,
    cert_name: str | None = None,
    server_name: str | None = None,
    timeout_s: float = 5.0,
) -> tuple[bool, str]:
    """(True, "SERVING") when ``service`` at ``address`` reports SERVING; else (False, why)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if tls_dir is None:
        channel = grpc.insecure_channel(address)
    else:
        name = cert_name or COORDINATOR_CERT_NAME
        files = read_tls_files(tls_dir, name)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=files.ca, private_key=files.key, certificate_chain=files.cert
        )
        options = [("grpc.ssl_target_name_override", server_name or name)]
        channel = grpc.secure_channel(address, credentials, options=options)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status
