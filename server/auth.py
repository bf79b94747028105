"""Who may connect as which worker: mutual TLS identities or a shared token.

- mTLS: the gRPC server requires a client certificate signed by the run's CA; the certificate's
  common name IS the worker id. A worker registering under another id is refused with
  PERMISSION_DENIED.
- shared token: ``authorization: Bearer <token>`` metadata, compared with ``hmac.compare_digest``
  (constant time). A missing or wrong token is refused with UNAUTHENTICATED.
- ``allowed_workers`` (optional): only these worker ids may register (PERMISSION_DENIED otherwise).
- ``insecure()`` accepts anyone; only for loopback tests and local simulation.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from userdp.proto.channels import TOKEN_METADATA_KEY, TlsFiles


@dataclass(frozen=True)
class Authorizer:
    token: str | None = None
    mtls: bool = False
    allowed_workers: frozenset[str] | None = None

    @classmethod
    def insecure(cls) -> Authorizer:
        return cls()

    @classmethod
    def with_token(cls, token: str, allowed_workers: Iterable[str] | None = None) -> Authorizer:
        allowed = frozenset(allowed_workers) if allowed_workers is not None else None
        return cls(token=token, allowed_workers=allowed)

    @classmethod
    def with_mtls(cls, allowed_workers: Iterable[str] | None = None) -> Authorizer:
        allowed = frozenset(allowed_workers) if allowed_workers is not None else None
        return cls(mtls=True, allowed_workers=allowed)

    def authenticate(self, context: grpc.ServicerContext) -> str | None:
        """The caller's certificate identity (mTLS) or None; aborts with UNAUTHENTICATED when the
        token is missing or wrong."""
        if self.token is not None:
            metadata = dict(context.invocation_metadata() or ())
            sent = metadata.get(TOKEN_METADATA_KEY, "")
            expected = f"Bearer {self.token}"
            if not hmac.compare_digest(sent.encode(), expected.encode()):
                context.abort(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "missing or wrong worker token (pass --token-file with the coordinator's token)",
                )
        if self.mtls:
            names = context.auth_context().get("x509_common_name") or []
            if not names:
                context.abort(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "no client certificate (mTLS is required; pass --tls-dir)",
                )
            return names[0].decode()
        return None

    def authorize(
        self, context: grpc.ServicerContext, identity: str | None, worker_id: str
    ) -> None:
        """Abort with PERMISSION_DENIED unless ``identity`` may act as ``worker_id``."""
        if self.mtls and identity != worker_id:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"certificate is for {identity!r}, but the worker registered as {worker_id!r}",
            )
        if self.allowed_workers is not None and worker_id not in self.allowed_workers:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"unknown worker {worker_id!r}; this coordinator accepts "
                f"{sorted(self.allowed_workers)}",
            )


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Server TLS that requires and verifies a client certificate (mutual TLS)."""
    return grpc.ssl_server_credentials(
        [(files.key, files.cert)], root_certificates=files.ca, require_client_auth=True
    )
