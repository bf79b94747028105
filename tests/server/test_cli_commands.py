"""`userdp coordinator` / `userdp worker`: registered, and bad input is a one-line error (exit 2)."""

from __future__ import annotations

import pytest

from userdp.cli import main


def test_commands_are_registered(capsys):
    for command in ("coordinator", "worker", "certs"):
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--coordinator" in out and "--health-port" in out and "--allow-workers" in out


def test_worker_rejects_a_bad_coordinator_address(tmp_path, capsys):
    code = main(["worker", "--coordinator", "nohostport", "--shards", str(tmp_path)])
    assert code == 2
    assert "--coordinator must be HOST:PORT" in capsys.readouterr().err


def test_worker_rejects_a_missing_shard_dir(tmp_path, capsys):
    code = main(["worker", "--coordinator", "127.0.0.1:1", "--shards", str(tmp_path / "none")])
    assert code == 2
    assert "manifest" in capsys.readouterr().err


def test_coordinator_needs_a_shard_directory(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text("[coordinator]\nport = 0\n")
    assert main(["coordinator", "--config", str(config)]) == 2
    assert "data.shards" in capsys.readouterr().err
