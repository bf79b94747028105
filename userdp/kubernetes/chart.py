"""The chart's fixed names: its release naming, ports, certificate names, where it mounts things in
the pods (deploy/helm/userdp/templates/_helpers.tpl) and the config keys it sets itself."""

from __future__ import annotations

CHART_NAME = "userdp"


DEFAULT_PORT = 50051


# The coordinator's rendezvous store with ``coordinator.data_plane = "collective"`` (values
# coordinator.groupPort; the port torch.distributed's own rendezvous uses by convention).
DEFAULT_GROUP_PORT = 29400


COORDINATOR_CERT_NAME = "coordinator"


# Where the chart mounts things inside the pods (deploy/helm/userdp/templates/_helpers.tpl).
DEPLOY_PATHS: dict[str, str] = {
    "config_dir": "/etc/userdp/config",
    "config_file": "/etc/userdp/config/userdp.toml",
    "tls_dir": "/etc/userdp/tls",
    "token_file": "/etc/userdp/token/token",
    "data_dir": "/data",
    "shards": "/data/shards",
    "state_dir": "/var/lib/userdp",
    "output_dir": "/var/lib/userdp/run",
}


# Config keys the chart sets itself, and what it sets them to.
CHART_MANAGED_KEYS: dict[tuple[str, str], str] = {
    ("data", "shards"): f"{DEPLOY_PATHS['shards']} (shards/ on the data volume)",
    ("coordinator", "host"): "0.0.0.0",
    ("coordinator", "port"): "values coordinator.port",
    ("coordinator", "group_port"): (
        'values coordinator.groupPort when coordinator.data_plane = "collective" (unused otherwise)'
    ),
    ("coordinator", "tls_dir"): f"{DEPLOY_PATHS['tls_dir']} when values tls.enabled",
    ("coordinator", "auth_token_file"): (
        f"{DEPLOY_PATHS['token_file']} when values authToken.enabled (and tls.enabled is false)"
    ),
    ("workers", "count"): "values workers.replicas",
    ("workers", "device"): "cuda when values workers.gpus > 0, else cpu",
    ("workers", "ranks"): (
        "one rank per GPU: values workers.gpus (deploy render --gpus); on CPU values "
        "workers.cpuRanks"
    ),
    ("output", "dir"): f"{DEPLOY_PATHS['output_dir']} (on the coordinator's state volume)",
}


def chart_fullname(release: str) -> str:
    """The chart's ``userdp.fullname`` for a release (no overrides): the prefix of every object."""
    name = release if CHART_NAME in release else f"{release}-{CHART_NAME}"
    return name[:40].removesuffix("-")


def worker_ids(release: str, count: int) -> list[str]:
    """Worker ids (= StatefulSet pod names = certificate common names) of a release."""
    return [f"{chart_fullname(release)}-worker-{index}" for index in range(count)]
