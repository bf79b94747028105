"""A worker of N ranks (clients/ranks.py): rank 0 broadcasts model versions and tasks, every rank
joins the engine's collective clipped sum, and rank 0's result equals a one-process worker's for
the same model and units. A rank that cannot read a task's units fails that task on every rank
without hanging; a rank 0 that dies does not leave the others waiting. The ranks run under
torch's launcher (gloo), as the chart runs them, without DeepSpeed or gRPC
(tests/clients/worker_rank_main.py); the full worker against a coordinator is
tests/deploy/test_multi_rank_worker.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file
from userdp.clients.engine import ClippingEngine, Unit
from userdp.clients.worker_service import EngineCompute

from tests.clients import worker_rank_main as rank_main
from tests.clients.engine_fixtures import assert_sums_close, tiny_model

RANK_MAIN = Path(rank_main.__file__)


def launch(tmp_path: Path, scenario: str, timeout: float = 300) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    argv += [str(RANK_MAIN), str(tmp_path), scenario]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def one_process_worker():
    """The same model version and task on one rank (no process group)."""
    engine = ClippingEngine(tiny_model(seed=0), engine="loop")
    compute = EngineCompute(rank_main.ByteStore(), engine, Unit)
    compute.apply_model(rank_main.model_version(engine.module), full=True)
    return compute.compute(rank_main.task("t1", rank_main.GOOD_UNITS))


def test_two_ranks_serve_tasks_like_one_and_survive_a_rank_that_cannot_read(tmp_path):
    result = launch(tmp_path, "serve")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert {p.name for p in tmp_path.glob("followed-*")} == {"followed-0", "followed-1"}
    facts = json.loads((tmp_path / "rank0.json").read_text())
    assert facts["world"] == 2 and facts["group_left"]
    (error,) = facts["errors"]
    assert "another rank of this worker could not read the units of task t2" in error, error
    assert "injected read error" in result.stdout + result.stderr  # rank 1's own log line

    reference = one_process_worker()
    assert reference.stats.count == len(rank_main.GOOD_UNITS)
    assert 0 < reference.stats.clipped < reference.stats.count
    for name in ("first.st", "again.st"):
        assert_sums_close(load_file(str(tmp_path / name)), reference.sums, rtol=2e-5)
    stats = facts["stats"]
    for key in ("count", "nonfinite", "clipped", "tokens"):
        assert stats[key] == getattr(reference.stats, key), key
    for key in ("norm_min", "norm_max", "norm_sum", "loss_sum"):
        assert abs(stats[key] - getattr(reference.stats, key)) <= 1e-5 * abs(stats[key]), key


def test_a_rank_0_that_dies_ends_the_others_instead_of_leaving_them_waiting(tmp_path):
    result = launch(tmp_path, "rank0-dies", timeout=120)
    assert result.returncode != 0
    assert not list(tmp_path.glob("followed-*"))
