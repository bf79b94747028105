"""Coordinator + workers over real gRPC on loopback: exactly-once sums, replicas, resync."""

from __future__ import annotations

import torch

from .harness import make_loopback, reference_params
from .standins import uls_strategy

ALL = ["shard-00000", "shard-00001", "shard-00002", "shard-00003"]


def test_steps_equal_noiseless_single_process_reference(tmp_path):
    loop = make_loopback(tmp_path)
    try:
        loop.add_worker("w0", ["shard-00000", "shard-00001"])
        loop.add_worker("w1", ["shard-00001", "shard-00002", "shard-00003"])
        loop.add_worker("w2", ["shard-00003", "shard-00000", "shard-00002"])
        loop.coordinator.wait_for_workers()
        reports = loop.coordinator.run(3)
    finally:
        loop.close()
    expected = reference_params(uls_strategy(), loop.coordinator.population, 3)
    for name, value in loop.coordinator.params.items():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=1e-5)
    assert [r.step for r in reports] == [0, 1, 2]
    assert all(r.units == r.stats.count for r in reports)
    assert [r["step"] for r in loop.coordinator.ledger.records] == [0, 1, 2]


def test_worker_reconnects_with_backoff_after_coordinator_restart(tmp_path):
    from .toy import ToyCompute

    loop = make_loopback(tmp_path)
    port = loop.server.port
    compute = ToyCompute()
    client = loop.add_worker("w0", ALL, compute=compute)
    try:
        loop.coordinator.wait_for_workers()
        loop.coordinator.run(2)
    finally:
        loop.server.stop(grace=0)  # the coordinator goes away; the worker keeps retrying
        loop.coordinator.ledger.close()  # its writer lock goes with it
    loop2 = make_loopback(tmp_path, port=port)
    try:
        assert loop2.coordinator.step == 2
        loop2.coordinator.wait_for_workers()
        assert client.sessions == 2
        loop2.coordinator.run(3)
    finally:
        client.stop()
        loop2.close()
        loop.close()
    expected = reference_params(uls_strategy(), loop.coordinator.population, 3)
    for name, value in loop2.coordinator.params.items():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=1e-5)


def test_budget_stops_the_run_before_the_step_that_would_exceed_it(tmp_path):
    from userdp.accounting import UlsMechanism, epsilon

    from .standins import open_ledger

    budget = epsilon(UlsMechanism(noise_multiplier=1.0, sampling_prob=0.3), 2, 1e-5) * 1.001
    ledger = open_ledger(tmp_path / "ledger.jsonl", budget_epsilon=budget, delta=1e-5)
    loop = make_loopback(tmp_path, ledger=ledger)
    try:
        loop.add_worker("w0", ALL)
        loop.coordinator.wait_for_workers()
        reports = loop.coordinator.run(10)
    finally:
        loop.close()
    assert loop.coordinator.budget_exhausted and len(reports) == 2
    assert [r["step"] for r in ledger.records] == [0, 1]
    assert loop.coordinator.model_version == 2  # nothing of step 2 was released
