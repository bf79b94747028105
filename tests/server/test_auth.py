"""Authentication: shared token (constant-time compare), allow-list, mutual TLS identities."""

from __future__ import annotations

import dataclasses
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from userdp.clients.grpc_client import WorkerRefusedError
from userdp.proto.channels import read_tls_files
from userdp.server.auth import Authorizer
from userdp.server.certs import make_dev_ca

from . import toy
from .harness import make_loopback

ALL = ["shard-00000", "shard-00001", "shard-00002", "shard-00003"]
TOKEN = "s3cret-token-0123456789"


def _refusal(client, timeout=120.0) -> WorkerRefusedError:
    deadline = time.monotonic() + timeout
    while not client.errors and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.errors, "worker was not refused"
    error = client.errors[0]
    assert isinstance(error, WorkerRefusedError)
    return error


def test_token_accepts_right_and_refuses_wrong_or_missing(tmp_path):
    loop = make_loopback(tmp_path, authorizer=Authorizer.with_token(TOKEN))
    try:
        wrong = loop.add_worker("w-wrong", ALL, token="not-the-token-0000000")
        missing = loop.add_worker("w-missing", ALL)
        assert _refusal(wrong).code == grpc.StatusCode.UNAUTHENTICATED
        assert "token" in _refusal(missing).details
        loop.add_worker("w-right", ALL, token=TOKEN)
        loop.coordinator.wait_for_workers()
        loop.coordinator.run(1)
    finally:
        loop.close()


def test_unknown_worker_refused_with_permission_denied(tmp_path):
    auth = Authorizer.with_token(TOKEN, allowed_workers=["w0"])
    loop = make_loopback(tmp_path, authorizer=auth)
    try:
        intruder = loop.add_worker("w9", ALL, token=TOKEN)
        error = _refusal(intruder)
        assert error.code == grpc.StatusCode.PERMISSION_DENIED and "w9" in error.details
    finally:
        loop.close()


def test_shard_with_wrong_sha256_is_refused(tmp_path):
    loop = make_loopback(tmp_path)
    try:
        client = loop.add_worker("w0", ALL, holdings=[("shard-00000", "0" * 64)])
        error = _refusal(client)
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION and "sha256" in error.details
    finally:
        loop.close()


def test_worker_with_another_manifest_is_refused(tmp_path):
    """Same shard names and hashes, but another manifest.json (another `userdp shard` run):
    refused, naming both hashes; the coordinator's own manifest is accepted."""
    population = dataclasses.replace(toy.toy_population(), manifest_sha256="a" * 64)
    loop = make_loopback(tmp_path, population=population)
    try:
        client = loop.add_worker("w0", ALL, manifest_sha256="b" * 64)
        error = _refusal(client)
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "different shard set" in error.details and "bbbbbbbbbbbb" in error.details
        loop.add_worker("w1", ALL, manifest_sha256="a" * 64)
        loop.coordinator.wait_for_workers()
        loop.coordinator.run(1)
    finally:
        loop.close()


def test_mtls_identity_must_match_worker_id(tmp_path):
    certs = tmp_path / "certs"
    make_dev_ca(certs, ["coordinator", "worker-0", "worker-1"])
    loop = make_loopback(
        tmp_path, authorizer=Authorizer.with_mtls(), tls=read_tls_files(certs, "coordinator")
    )
    try:
        impostor = loop.add_worker("worker-0", ALL, tls=read_tls_files(certs, "worker-1"))
        error = _refusal(impostor)
        assert error.code == grpc.StatusCode.PERMISSION_DENIED and "worker-1" in error.details
        loop.add_worker("worker-0", ALL, tls=read_tls_files(certs, "worker-0"))
        loop.coordinator.wait_for_workers()
        loop.coordinator.run(1)
        # a client without a certificate cannot even complete the handshake
        creds = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
        channel = grpc.secure_channel(
            loop.server.address, creds, options=[("grpc.ssl_target_name_override", "coordinator")]
        )
        with pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        channel.close()
    finally:
        loop.close()


def test_coordinator_health_endpoint(tmp_path):
    loop = make_loopback(tmp_path)
    try:
        with grpc.insecure_channel(loop.server.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "userdp.v1.Coordinator"):
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        loop.close()
