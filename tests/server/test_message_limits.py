"""gRPC message limits: tensors larger than any one message stream in chunks sized by BOTH ends'
limits, and a worker that could not receive the model's chunks is refused at once with a message
naming the setting to raise (instead of failing every broadcast and reconnecting forever)."""

from __future__ import annotations

import time

import torch
from userdp.clients.grpc_client import WorkerRefusedError

from . import toy
from .harness import make_loopback, reference_params
from .standins import uls_strategy

ALL = ["shard-00000", "shard-00001", "shard-00002", "shard-00003"]
LIMIT = 1 << 20  # the coordinator's limit; the model and every result are ~6 MB


def test_model_and_results_over_the_limit_stream_in_chunks_both_ways(tmp_path, monkeypatch):
    monkeypatch.setattr(toy, "SHAPES", {"w": (1_500_000,), "b": (2, 3)})
    loop = make_loopback(tmp_path, publisher_chunk_bytes=LIMIT // 4, max_message_bytes=LIMIT)
    try:
        # the worker's own limit (64 MiB) would cut its results into 4 MiB chunks, four times
        # the coordinator's limit: it must size them by the limit the Welcome announces
        client = loop.add_worker("w0", ALL)
        loop.coordinator.wait_for_workers()
        loop.coordinator.run(2)
    finally:
        loop.close()
    assert client.chunk_bytes > LIMIT and client.session_chunk_bytes == LIMIT // 2
    assert not client.errors
    expected = reference_params(uls_strategy(), loop.coordinator.population, 2)
    for name, value in loop.coordinator.params.items():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=1e-5)


def test_a_worker_that_cannot_receive_the_model_chunks_is_refused(tmp_path):
    loop = make_loopback(tmp_path, publisher_chunk_bytes=LIMIT // 4, max_message_bytes=LIMIT)
    try:
        small = loop.add_worker("w-small", ALL, max_message_bytes=LIMIT // 8)
        deadline = time.monotonic() + 120
        while not small.errors and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        loop.close()
    assert small.errors, "the worker was not refused"
    error = small.errors[0]
    assert isinstance(error, WorkerRefusedError)
    assert "--max-message-mb" in str(error) and str(LIMIT // 8) in str(error)
