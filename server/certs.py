"""A development certificate authority for mTLS between coordinator and workers.

``make_dev_ca(out, names)`` writes ``ca.pem`` / ``ca.key`` and, per name, ``<name>.pem`` /
``<name>.key``: an EC P-256 key and a certificate signed by the CA whose common name is the name
(the worker id, or ``coordinator``) and whose subjectAltName lists the name, ``localhost`` and
127.0.0.1. Certificates are valid for ``days`` days and usable for both server and client
authentication. Private keys are written with mode 0600. For production, use your own PKI with the
same layout (the coordinator checks CA signature and that CN == worker id).

:func:`read_coordinator_tls` reads the coordinator's files; when some are missing, its error gives
the ``userdp certs dev-ca`` command that writes them, with ``--names`` listing ``coordinator`` and
the workers' ids.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from userdp.proto.channels import TlsFiles, read_tls_files

COORDINATOR_NAME = "coordinator"
"""The certificate name (CN) of the coordinator; workers' certificates are named by worker id."""


def dev_ca_names(worker_ids: Sequence[str] | None = None) -> str:
    """``--names`` for ``userdp certs dev-ca``: ``coordinator`` then each worker id once, or a
    placeholder for the ids when they are not known here."""
    names = [COORDINATOR_NAME]
    for worker_id in worker_ids or ():
        if worker_id not in names:
            names.append(worker_id)
    if len(names) == 1:
        names.append("<worker-id>,...")
    return ",".join(names)


def read_coordinator_tls(tls_dir: str | Path, worker_ids: Sequence[str] | None = None) -> TlsFiles:
    """``ca.pem``, ``coordinator.pem`` and ``coordinator.key`` from ``tls_dir``. ValueError naming
    the missing files and the ``userdp certs dev-ca`` command that writes them (``--names``: the
    coordinator and ``worker_ids``, e.g. the ``--allow-workers`` list)."""
    tls_dir = Path(tls_dir)
    files = ("ca.pem", f"{COORDINATOR_NAME}.pem", f"{COORDINATOR_NAME}.key")
    missing = [str(tls_dir / name) for name in files if not (tls_dir / name).is_file()]
    if missing:
        raise ValueError(
            f"coordinator.tls_dir = {str(tls_dir)!r}: missing {', '.join(missing)} (make them "
            f"with `userdp certs dev-ca --out {tls_dir} --names {dev_ca_names(worker_ids)}`, "
            "naming every worker by its --worker-id)"
        )
    return read_tls_files(tls_dir, COORDINATOR_NAME)


def _name(common_name: str) -> x509.Name:

    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "userdp dev CA"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:

    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _check_name(name: str) -> None:
    if not name or any(c in name for c in "/\\ \t\n") or name.startswith("."):
        raise ValueError(
            f"--names: {name!r} is not a usable certificate name (letters, digits, '-', '_', '.')"
        )


def make_dev_ca(out: str | Path, names: Sequence[str], days: int = 365) -> list[Path]:
    """Write a CA and one key/certificate pair per name into ``out``; return the written files."""

    for name in names:
        _check_name(name)
    if "ca" in names:
        raise ValueError("--names: 'ca' is reserved for the authority itself")
    if days < 1:
        raise ValueError(f"--days must be >= 1, got {days}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("userdp dev CA"))
        .issuer_name(_name("userdp dev CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    written = [out / "ca.pem", out / "ca.key"]
    written[0].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(written[1], ca_key)
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName(name),
                        x509.DNSName("localhost"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    ]
                ),
                critical=False,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        cert_path, key_path = out / f"{name}.pem", out / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key_path, key)
        written += [cert_path, key_path]
    return written
