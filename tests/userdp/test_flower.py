"""A 2-round Flower simulation of a userdp strategy: per-user clipping on nodes holding many
users, noise and ledger on the server."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from userdp.strategies import NoiseRng, Sgd, UserLevelSampling
from userdp.strategies.noise import GaussianNoise
from userdp.strategies.toy import PartitionedUsers, ToyMeanEstimation

from tests.strategies.helpers import ListLedger
from userdp.run.flower import UserDpFlowerStrategy, make_client_app

NODES = 3


RAY_STARTUP_TIMEOUT = "timed out during startup"  # ray's raylet registration wait (30 s, fixed)
RAY_START_ATTEMPTS = 5


def _ray_startup_timed_out(error: BaseException | None) -> bool:
    while error is not None:
        if RAY_STARTUP_TIMEOUT in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _start_ray() -> None:
    """Start the local Ray cluster the simulation then reuses (Flower's Ray backend starts one
    only when none is running). Ray waits a fixed 30 s for its raylet to register, with no
    setting to lengthen it, and a loaded machine can miss that window: a start that timed out
    is retried, up to RAY_START_ATTEMPTS times; any other error fails at once."""
    import os
    import sys

    import ray

    pythonpath = os.pathsep.join(sys.path)  # what Flower's backend passes to its actors
    # Ray runs its workers at niceness 15: on a loaded machine they then get almost no CPU (a
    # node's import of scipy took minutes beside six busy loops). The raylet reads its
    # worker_niceness from the environment when it starts.
    os.environ["RAY_worker_niceness"] = "0"
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            ray.init(include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
            return
        except Exception as exc:
            ray.shutdown()
            if not _ray_startup_timed_out(exc) or attempt == RAY_START_ATTEMPTS:
                raise


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
    _start_ray()
    strategy, ledger, adapter, worker = _two_rounds(flwr_sim)
    assert adapter.released_steps == [0, 1]
    assert [step for step, _ in ledger.entries] == [0, 1]
    assert ledger.entries[0][1] == strategy.mechanism().to_dict()
    assert sorted(adapter.node_of_user) == sorted(worker.data)
    assert len(set(adapter.node_of_user.values())) == NODES
    assert np.linalg.norm(adapter.params["theta"]) > 0


def test_task_spec_round_trips_through_a_config_record():
    from userdp.strategies.base import TaskSpec

    from userdp.run.flower import _task_from_config, _task_to_config

    task = TaskSpec(clip_norm=0.5, unit="example", group_size=4, local_steps=2, local_lr=0.1)
    config = _task_to_config(task, ["u1/0", "u2/3"], step=7)
    assert _task_from_config(config) == (task, ["u1/0", "u2/3"], 7)
