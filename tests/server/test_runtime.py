"""start_coordinator: security chosen from the config; refuses an open port without auth."""

from __future__ import annotations

import grpc
import pytest
from userdp.server.runtime import start_coordinator

from userdp.config import parse_config

from . import toy
from .standins import open_ledger, uls_strategy


def _start(tmp_path, coordinator):
    config = parse_config({"coordinator": coordinator})
    return start_coordinator(
        config,
        strategy=uls_strategy(),
        ledger=open_ledger(tmp_path / "ledger.jsonl"),
        params=toy.initial_params(),
        population=toy.toy_population(),
        checkpoint_dir=tmp_path / "ckpt",
    )


def test_non_loopback_host_without_auth_is_refused(tmp_path):
    with pytest.raises(ValueError, match="tls_dir"):
        _start(tmp_path, {"host": "0.0.0.0"})


def test_token_from_config_is_enforced(tmp_path):
    from userdp.clients.grpc_client import Backoff, WorkerClient, WorkerRefusedError

    token_file = tmp_path / "token"
    token_file.write_text("a-long-shared-token-value\n")
    running = _start(tmp_path, {"auth_token_file": str(token_file)})
    try:
        population = toy.toy_population()
        shards = list(population.shard_sha256.items())
        wrong = WorkerClient(
            f"127.0.0.1:{running.server.port}",
            "w0",
            shards,
            toy.ToyCompute(),
            token="another-token-of-length",
            backoff=Backoff(0.05, 0.1),
        )
        with pytest.raises(WorkerRefusedError) as refused:
            wrong.run()
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        running.stop(finished=True)
