"""The Secret manifests the chart mounts: TLS certificates of the coordinator and each worker, and
the shared token."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from userdp.kubernetes.chart import (
    CHART_NAME,
    COORDINATOR_CERT_NAME,
    chart_fullname,
    worker_ids,
)
from userdp.proto.channels import read_token


def _secret(name: str, files: dict[str, bytes], namespace: str | None) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": name,
        "labels": {"app.kubernetes.io/name": CHART_NAME, "app.kubernetes.io/part-of": CHART_NAME},
    }
    if namespace:
        metadata["namespace"] = namespace
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
        "type": "Opaque",
        "data": {key: base64.b64encode(data).decode("ascii") for key, data in files.items()},
    }


def secret_manifests(
    tls_dir: str | Path | None,
    release: str,
    workers: int,
    *,
    token_file: str | Path | None = None,
    namespace: str | None = None,
) -> list[dict[str, Any]]:
    """The Secrets the chart mounts: ``<fullname>-tls-coordinator`` (ca.pem, coordinator.pem/key),
    ``<fullname>-tls-workers`` (ca.pem and each worker's <id>.pem/key) and ``<fullname>-token``.

    Raises ValueError naming the first missing file: a worker without its certificate could not
    connect, so it is better to fail here than in the pod.
    """
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    fullname = chart_fullname(release)
    manifests = []
    if tls_dir is not None:
        tls_dir = Path(tls_dir)

        def read(name: str) -> bytes:
            path = tls_dir / name
            if not path.is_file():
                raise ValueError(
                    f"--tls-dir {tls_dir}: missing {name} (issue it with `userdp certs dev-ca "
                    f"--out {tls_dir} --names coordinator,{','.join(worker_ids(release, workers))}`)"
                )
            return path.read_bytes()

        ca = read("ca.pem")
        coordinator = {
            "ca.pem": ca,
            f"{COORDINATOR_CERT_NAME}.pem": read(f"{COORDINATOR_CERT_NAME}.pem"),
            f"{COORDINATOR_CERT_NAME}.key": read(f"{COORDINATOR_CERT_NAME}.key"),
        }
        worker_files = {"ca.pem": ca}
        for worker_id in worker_ids(release, workers):
            worker_files[f"{worker_id}.pem"] = read(f"{worker_id}.pem")
            worker_files[f"{worker_id}.key"] = read(f"{worker_id}.key")
        manifests.append(_secret(f"{fullname}-tls-coordinator", coordinator, namespace))
        manifests.append(_secret(f"{fullname}-tls-workers", worker_files, namespace))
    if token_file is not None:
        token = read_token(token_file)
        manifests.append(_secret(f"{fullname}-token", {"token": token.encode()}, namespace))
    if not manifests:
        raise ValueError("nothing to write: give --tls-dir, --token-file or both")
    return manifests
