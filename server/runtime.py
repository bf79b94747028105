"""Wire a coordinator from the run's config: security, message limits, deadlines, checkpoints.

:func:`start_coordinator` is what ``userdp coordinator`` (and ``userdp simulate``) call once they
have the strategy, the ledger, the model tensors and the population: it picks the authentication
from ``[coordinator]`` (mTLS with ``tls_dir``, else the shared token of ``auth_token_file``, else
unauthenticated — allowed on a loopback host only, and logged as a warning), starts the gRPC
server, and returns the resumed :class:`~userdp.server.coordinator.Coordinator` with its server.
A set port that cannot be listened on (``coordinator.port``, ``coordinator.group_port``) is one
line naming the key and what to change (:func:`port_problem`), never a library's error.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from userdp.proto.channels import TlsFiles, chunk_bytes_within, read_token
from userdp.server.auth import Authorizer
from userdp.server.certs import read_coordinator_tls
from userdp.server.coordinator import Coordinator, CoordinatorSettings
from userdp.server.group_plane import GroupPlane, GroupSettings
from userdp.server.grpc_server import ListenError, RunningServer, serve
from userdp.server.population import Population
from userdp.server.publisher import ModelPublisher
from userdp.server.registry import WorkerRegistry
from userdp.server.sum_plane import StreamedPlane, SumPlane

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
INSECURE_WARNING = (
    "unauthenticated loopback mode: any local process can connect as a worker; set "
    "coordinator.tls_dir or coordinator.auth_token_file"
)


@dataclass
class RunningCoordinator:
    coordinator: Coordinator
    server: RunningServer

    def stop(self, finished: bool) -> None:
        """Stop serving; ``finished`` tells workers to exit, otherwise they wait for a restart."""
        self.server.stop(grace=5, drain_workers=finished)


def authorizer_from_config(
    coordinator_config: Any, allowed_workers: Iterable[str] | None = None
) -> tuple[Authorizer, TlsFiles | None]:
    """mTLS when ``tls_dir`` is set, else the shared token, else loopback-only insecure (logged
    as a warning: :data:`INSECURE_WARNING`)."""
    c = coordinator_config
    if c.tls_dir:
        allowed = list(allowed_workers) if allowed_workers is not None else None
        return Authorizer.with_mtls(allowed), read_coordinator_tls(c.tls_dir, allowed)
    if c.auth_token_file:
        return Authorizer.with_token(read_token(c.auth_token_file), allowed_workers), None
    if c.host not in LOOPBACK_HOSTS:
        raise ValueError(
            f"coordinator.host = {c.host!r} is not a loopback address: set coordinator.tls_dir "
            "(mTLS) or coordinator.auth_token_file (shared token)"
        )
    log.warning(INSECURE_WARNING)
    return Authorizer.insecure(), None


def start_coordinator(
    config: Any,
    *,
    strategy: Any,
    ledger: Any,
    params: dict[str, torch.Tensor],
    population: Population,
    checkpoint_dir: str | Path,
    frozen: Mapping[str, torch.Tensor] | None = None,
    allowed_workers: Iterable[str] | None = None,
    options: Any = None,
    test_only_disable_noise: bool = False,
    data_check: Callable[[], None] | None = None,
) -> RunningCoordinator:
    """Serve ``config.coordinator`` and return the resumed coordinator (see the module docstring).
    ``options``: the run's :class:`~userdp.strategies.step.ExecutionOptions`; ``data_check``:
    raises when the shard folder is gone (:class:`~userdp.server.coordinator.Coordinator`).

    ``test_only_disable_noise`` (test-only, NOT PRIVATE): see
    :class:`~userdp.server.coordinator.Coordinator`; no config key or CLI flag reaches it."""
    authorizer, tls = authorizer_from_config(config.coordinator, allowed_workers)
    max_message_bytes = config.coordinator.max_message_mb << 20
    # model chunks of at most half the message limit (1 MiB by default) fit every peer that
    # shares the limit
    registry = WorkerRegistry()
    publisher = ModelPublisher(chunk_bytes=chunk_bytes_within(1 << 20, max_message_bytes))
    partial_bytes = sum(t.numel() * t.element_size() for t in params.values())
    plane = _sum_plane(config.coordinator)
    _check_port("coordinator.port", config.coordinator.host, config.coordinator.port)
    try:
        server = serve(
            registry,
            publisher,
            authorizer,
            population.shard_sha256,
            manifest_sha256=population.manifest_sha256,
            host=config.coordinator.host,
            port=config.coordinator.port,
            tls=tls,
            max_message_bytes=max_message_bytes,
            max_partial_bytes=2 * partial_bytes + (1 << 20),
        )
    except ListenError as exc:  # taken since the check
        raise ValueError(
            port_problem("coordinator.port", exc.host, exc.port)
            or f"coordinator.port = {exc.port}: {exc}: set coordinator.port to another port"
        ) from None
    deadline = config.coordinator.step_deadline_s
    coordinator = Coordinator(
        strategy=strategy,
        ledger=ledger,
        params=params,
        frozen=frozen,
        population=population,
        registry=registry,
        publisher=publisher,
        checkpoint_dir=checkpoint_dir,
        settings=CoordinatorSettings(
            step_deadline_s=deadline,
            task_deadline_s=deadline / 2,
            checkpoint_every=config.coordinator.checkpoint_every,
            worker_startup_s=config.coordinator.worker_startup_s,
            worker_stall_s=config.coordinator.worker_stall_s,
        ),
        options=options,
        test_only_disable_noise=test_only_disable_noise,
        plane=plane,
        data_check=data_check,
    )
    try:
        coordinator.resume()
    except BaseException:
        server.stop(grace=0)
        raise
    return RunningCoordinator(coordinator, server)


def _sum_plane(config: Any) -> SumPlane:
    """The data plane of ``coordinator.data_plane``: gRPC, or the collective plane with its
    rendezvous."""
    if config.data_plane != "collective":
        return StreamedPlane()
    settings = GroupSettings(
        store_port=config.group_port, timeout_s=config.group_timeout_s, store_bind=config.host
    )
    _check_port("coordinator.group_port", settings.store_bind, settings.store_port)
    try:
        plane = GroupPlane(settings)
    except dist.DistNetworkError as exc:  # taken since the check
        raise ValueError(
            port_problem("coordinator.group_port", settings.store_bind, settings.store_port)
            or f"coordinator.group_port = {settings.store_port}: {exc}"
        ) from None
    log.info("collective data plane: workers' rendezvous store on port %d", plane.port)
    if config.tls_dir or config.auth_token_file:
        log.warning(
            "collective data plane: the workers' group (gloo) and its rendezvous store on port "
            "%d are neither encrypted nor authenticated, unlike the gRPC channel: keep them on a "
            "network only the coordinator and the workers reach (docs/privacy.md)",
            plane.port,
        )
    return plane


def _check_port(key: str, host: str, port: int) -> None:
    """A set port (``key``) that cannot be listened on stops the run here, with one line, before
    a server library tries it and logs its own error (0 = any free port: nothing to check)."""
    problem = port_problem(key, host, port) if port else ""
    if problem:
        raise ValueError(problem)


def port_problem(key: str, host: str, port: int) -> str:
    """One line saying why the coordinator cannot listen on ``host:port``, which ``key`` sets,
    and what to change; "" when it can (a test bind, as the servers bind, finds the reason)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host.strip("[]"), port))
        return ""
    except socket.gaierror:
        code = errno.EADDRNOTAVAIL
    except OSError as exc:
        code = exc.errno or 0
    if code == errno.EADDRINUSE:
        return (
            f"{key} = {port}: {host}:{port} is in use (another run or program listens there): "
            f"stop it, or set {key} to a free port (0 picks one)"
        )
    if code == errno.EACCES:
        return f"{key} = {port}: a port below 1024 needs privileges: set {key} to 1024 or above"
    if code == errno.EADDRNOTAVAIL:
        return (
            f"coordinator.host = {host!r} is not an address of this machine: set coordinator.host "
            "to one of its addresses (0.0.0.0 for all of them)"
        )
    return (
        f"{key} = {port}: cannot listen on {host}:{port} ({errno.errorcode.get(code, code)}): "
        f"set {key} to another port"
    )
