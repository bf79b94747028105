"""Wire settings shared by coordinator and worker: message limits, keepalive, TLS files, tokens.

Both ends set explicit send/receive limits (``max_message_bytes``); tensors are chunked well
below them (:mod:`userdp.proto.tensors`). Security material:

- mTLS: a directory with ``ca.pem`` and ``<name>.pem`` / ``<name>.key`` per party (``userdp certs
  dev-ca`` writes one). The worker's certificate common name is its worker id.
- shared token: a file holding one line; sent as ``authorization: Bearer <token>`` metadata and
  compared in constant time. Without TLS the token crosses the network in clear text: use it only
  on a trusted network, or together with TLS.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROTOCOL_VERSION = 1
TOKEN_METADATA_KEY = "authorization"
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
SERVICE_NAME = "userdp.v1.Coordinator"
WORKER_HEALTH_SERVICE = "userdp.v1.Worker"


def chunk_bytes_within(preferred: int, max_message_bytes: int) -> int:
    """Tensor chunk size for a peer that accepts messages up to ``max_message_bytes``: at most
    half of it, so a chunk with its envelope always fits (0 = limit unknown: ``preferred``)."""
    return min(preferred, max_message_bytes // 2) if max_message_bytes else preferred


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """gRPC options for both ends: explicit message limits and keepalive (dead peers surface as a
    stream error within ~30 s instead of a hang)."""
    return [
        ("grpc.max_send_message_length", int(max_message_bytes)),
        ("grpc.max_receive_message_length", int(max_message_bytes)),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        *channel_options(max_message_bytes),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.so_reuseport", 0),
    ]


def read_token(path: str | Path) -> str:
    """The shared token in ``path`` (first line, stripped); ValueError names the file if unusable."""
    path = Path(path)
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"token file {path}: cannot read ({exc.strerror})") from None
    if len(token) < 16:
        raise ValueError(f"token file {path}: token must be at least 16 characters")
    return token


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_METADATA_KEY, f"Bearer {token}"),)


@dataclass(frozen=True)
class TlsFiles:
    """PEM bytes of the CA and of one party's certificate chain and private key."""

    ca: bytes
    cert: bytes
    key: bytes


def read_tls_files(tls_dir: str | Path, name: str) -> TlsFiles:
    """``ca.pem``, ``<name>.pem``, ``<name>.key`` from ``tls_dir`` (ValueError names a missing one)."""
    tls_dir = Path(tls_dir)
    paths = [tls_dir / "ca.pem", tls_dir / f"{name}.pem", tls_dir / f"{name}.key"]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        names = ",".join(dict.fromkeys(["coordinator", name]))
        raise ValueError(
            f"--tls-dir {tls_dir}: missing {', '.join(missing)} (make them with `userdp certs "
            f"dev-ca --out {tls_dir} --names {names}`)"
        )
    return TlsFiles(*(p.read_bytes() for p in paths))
