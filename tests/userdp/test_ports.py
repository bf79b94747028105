"""A configured coordinator port that is in use stops ``simulate`` with one line naming the key
that sets it (``coordinator.port`` for gRPC, ``coordinator.group_port`` for the collective data
plane's rendezvous store); only an unset port (0) is replaced by a free one."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from userdp import cli
from userdp.config import parse_config
from userdp.run.components import prepare_run
from userdp.run.loop import resolved_config
from userdp.run.outputs import config_toml


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another program listens on (all interfaces, as the rendezvous store binds)."""
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _config_file(tmp_path: Path, **coordinator) -> Path:
    config = parse_config(
        {
            "data": {"demo_users": 40, "seq_len": 32, "eval_fraction": 0.1},
            "model": {"preset": "gpt2-tiny"},
            "strategy": {"steps": 2, "sampling_prob": 0.25, "group_size": 2, "engine": "loop"},
            "privacy": {"epsilon": 20.0},
            "coordinator": coordinator,
            "output": {"dir": str(tmp_path / "run"), "seed": 0, "plots": False},
        }
    )
    path = tmp_path / "run.toml"
    path.write_text(config_toml(config))
    return path


def _simulate_error(path: Path, capfd) -> str:
    """The last line of a failed ``simulate``; no library's own error reached stderr (read at
    the file descriptor, where gRPC's core and torch's c10d write)."""
    code = cli.main(["simulate", "--config", str(path)])
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2, err
    for library_line in ("EADDRINUSE", "add_port", "Failed to bind", "Traceback"):
        assert not any(library_line in line for line in err), err
    return err[-1]


def test_a_configured_grpc_port_in_use_is_one_line_naming_coordinator_port(
    tmp_path, busy_port, capfd
) -> None:
    line = _simulate_error(_config_file(tmp_path, port=busy_port), capfd)
    assert line == (
        f"userdp simulate: error: coordinator.port = {busy_port}: 127.0.0.1:{busy_port} is in "
        "use (another run or program listens there): stop it, or set coordinator.port to a free "
        "port (0 picks one)"
    )


def test_a_configured_rendezvous_port_in_use_is_one_line_naming_coordinator_group_port(
    tmp_path, busy_port, capfd
) -> None:
    path = _config_file(tmp_path, data_plane="collective", group_port=busy_port)
    line = _simulate_error(path, capfd)
    assert line.startswith(f"userdp simulate: error: coordinator.group_port = {busy_port}: ")
    assert "is in use" in line and "set coordinator.group_port to a free port (0 picks one)" in line
    assert "EADDRINUSE" not in line and "traceback" not in line


def test_simulate_keeps_a_configured_port_and_picks_one_only_when_unset(tmp_path) -> None:
    for port in (0, 50123):
        config = parse_config({"data": {"demo_users": 40}, "coordinator": {"port": port}})
        resolved = resolved_config(config, prepare_run(config), tmp_path, "grpc")
        assert resolved.coordinator.port == port
        assert resolved.coordinator.host == "127.0.0.1"  # simulate's workers are local
