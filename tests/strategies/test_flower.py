"""A 2-round Flower simulation of a userdp strategy: per-user clipping on nodes holding many
users, noise and ledger on the server."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from userdp.strategies import NoiseRng, Sgd, UserLevelSampling
from userdp.strategies.example_plugin import PartitionedUsers, ToyMeanEstimation
from userdp.strategies.flower import UserDpFlowerStrategy, make_client_app
from userdp.strategies.noise import GaussianNoise

from .helpers import ListLedger

NODES = 3


RAY_STARTUP_TIMEOUT = "timed out during startup"  # ray's fixed 30 s raylet registration wait


def _ray_startup_timed_out(error: BaseException) -> bool:
    while error is not None:
        if RAY_STARTUP_TIMEOUT in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _two_rounds(flwr_sim):
    strategy = UserLevelSampling(
        noise_multiplier=1.0,
        clip_norm=1.0,
        sampling_prob=0.5,
        noise=GaussianNoise(NoiseRng.for_testing(0)),
        optimizer=Sgd(0.5),
    )
    ledger = ListLedger()
    adapter = UserDpFlowerStrategy(strategy, ledger, min_nodes=NODES, timeout=120)
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        initial = ArrayRecord({"theta": Array(np.zeros(3))})
        adapter.start(grid, initial_arrays=initial, num_rounds=2, timeout=120)

    worker = ToyMeanEstimation(n_users=60, seed=4)  # importable: ray pickles it by reference
    client = make_client_app(worker, PartitionedUsers(worker.population, NODES))
    flwr_sim.run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=NODES,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    return strategy, ledger, adapter, worker


def test_two_round_flower_simulation_charges_the_ledger():
    flwr_sim = pytest.importorskip("flwr.simulation")
    try:
        strategy, ledger, adapter, worker = _two_rounds(flwr_sim)
    except RuntimeError as exc:
        # On a loaded 2-core machine ray's raylet sometimes misses its fixed startup window
        # (seen once in six CI runs): infrastructure, not the code under test. Retry once, with
        # a fresh strategy and ledger; any other failure, or a second timeout, fails the test.
        if not _ray_startup_timed_out(exc):
            raise
        strategy, ledger, adapter, worker = _two_rounds(flwr_sim)
    assert adapter.released_steps == [0, 1]
    assert [step for step, _ in ledger.entries] == [0, 1]
    assert ledger.entries[0][1] == strategy.mechanism().to_dict()
    assert sorted(adapter.node_of_user) == sorted(worker.data)
    assert len(set(adapter.node_of_user.values())) == NODES
    assert np.linalg.norm(adapter.params["theta"]) > 0


def test_task_spec_round_trips_through_a_config_record():
    from userdp.strategies.base import TaskSpec
    from userdp.strategies.flower import _task_from_config, _task_to_config

    task = TaskSpec(clip_norm=0.5, unit="example", group_size=4, local_steps=2, local_lr=0.1)
    config = _task_to_config(task, ["u1/0", "u2/3"], step=7)
    assert _task_from_config(config) == (task, ["u1/0", "u2/3"], 7)
