"""A worker SIGKILLed inside the collective plane's bucketed gloo reduce.

``simulate`` over the collective data plane with three workers, every shard held by two. The
reduce is cut into one bucket per tensor (28 for gpt2-tiny) and worker 1 stops inside step 1's
reduce once its first buckets' reduces are issued (:mod:`tests.userdp.paused_reduce_worker`);
the test SIGKILLs it there. The step aborts at the coordinator and at both survivors within the
group's timeout, nothing of it is charged or released, no noise was drawn for the aborted
attempt, and the retry (a group of the survivors) draws its noise once; the ledger and the
release journal agree on each release's commitment and ``ledger verify`` passes.
"""

from __future__ import annotations

import json
import re
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
from userdp.proto import gloo
from userdp.server.coordinator import Coordinator
from userdp.server.fleet import StepAborted
from userdp.server.group_plane import GroupPlane
from userdp.server.release_journal import read_release_records

from userdp import cli
from userdp.config import parse_config
from userdp.run import grpc_workers
from userdp.run.grpc_workers import kill_tree
from userdp.run.launch import run

REPO = Path(__file__).resolve().parents[2]
GROUP_TIMEOUT_S = 30.0
PATIENCE_S = 900.0
"""Outer bound on the wait for the third worker to start (a loaded 2-core machine)."""
KILL_STEP, VICTIM = 1, "sim-worker-1"
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _config(tmp_path: Path):
    return parse_config(
        {
            "data": {"demo_users": 40, "seq_len": 32, "eval_fraction": 0.1},
            "model": {"preset": "gpt2-tiny"},
            "strategy": {
                "steps": 3,
                "sampling_prob": 0.25,
                "group_size": 2,
                "engine": "loop",
                "server_optimizer": "sgd",
                "server_lr": 0.5,
            },
            "privacy": {"epsilon": 20.0},
            "workers": {"count": 3, "replicas": 2},
            "coordinator": {
                "step_deadline_s": 300.0,
                "data_plane": "collective",
                "group_timeout_s": GROUP_TIMEOUT_S,
            },
            "output": {"dir": str(tmp_path / "run"), "seed": 0, "plots": False},
        }
    )


def _logged_at(line: str) -> float:
    return datetime.strptime(LOG_TIME.match(line)[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()


@pytest.mark.slow
def test_a_worker_killed_inside_the_bucketed_reduce_aborts_the_step_everywhere(
    tmp_path, monkeypatch
) -> None:
    marker = tmp_path / "paused"
    monkeypatch.setattr(gloo, "BUCKET_ELEMENTS", 1)  # the workers cut the same buckets
    monkeypatch.setattr(grpc_workers, "WORKER_MODULE", "tests.userdp.paused_reduce_worker")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("USERDP_TEST_PAUSE_WORKER", VICTIM)
    monkeypatch.setenv("USERDP_TEST_PAUSE_STEP", str(KILL_STEP))
    monkeypatch.setenv("USERDP_TEST_PAUSE_MARKER", str(marker))

    spawned: list = []
    spawn = grpc_workers._spawn_workers

    def spawn_and_keep(loop, address):
        spawned[:] = spawn(loop, address)
        return spawned

    killed_at: list[float] = []
    done = threading.Event()

    def kill_the_victim_in_its_reduce() -> None:
        while not done.is_set():
            if marker.exists():
                kill_tree(spawned[int(VICTIM.rsplit("-", 1)[1])])
                killed_at.append(time.time())
                return
            time.sleep(0.01)

    aborted_at: list[float] = []
    reduce = GroupPlane.complete_gather

    def reduce_timing_the_abort(plane, fleet, collect, deadline):
        try:
            return reduce(plane, fleet, collect, deadline)
        except StepAborted:
            aborted_at.append(time.time())
            raise

    wait = Coordinator.wait_for_workers

    def wait_for_all_three(self, *args, **kwargs):
        """Every shard has two holders: the run could start without the victim, which would then
        take part in no reduce of step 1."""
        wait(self, *args, **kwargs)
        deadline = time.monotonic() + PATIENCE_S
        while len(self._eligible()) < 3:
            assert time.monotonic() < deadline, f"only {list(self._eligible())} became ready"
            self.pump_events(0.05)

    phases: list[tuple[str, int]] = []
    phase = Coordinator._phase

    def phase_recorded(self, name, step, times, started):
        phases.append((name, step))
        return phase(self, name, step, times, started)

    monkeypatch.setattr(grpc_workers, "_spawn_workers", spawn_and_keep)
    monkeypatch.setattr(GroupPlane, "complete_gather", reduce_timing_the_abort)
    monkeypatch.setattr(Coordinator, "_phase", phase_recorded)
    monkeypatch.setattr(Coordinator, "wait_for_workers", wait_for_all_three)
    killer = threading.Thread(target=kill_the_victim_in_its_reduce, daemon=True)
    killer.start()
    try:
        result = run(_config(tmp_path), quiet=True)
    finally:
        done.set()
        killer.join()
    assert killed_at, "the victim never reached the pause inside its reduce"
    assert result.steps_done == 3

    # the step aborted at the coordinator and at both survivors, within the group's timeout
    assert len(aborted_at) == 1 and aborted_at[0] - killed_at[0] < GROUP_TIMEOUT_S
    logs = tmp_path / "run" / "logs"
    for survivor in ("worker-0.log", "worker-2.log"):
        lines = (logs / survivor).read_text(errors="replace").splitlines()
        failed = [line for line in lines if f"reduce of step {KILL_STEP} failed" in line]
        assert failed, f"{survivor}: its reduce never failed: {lines[-20:]}"
        # log times have millisecond resolution
        assert _logged_at(failed[0]) - killed_at[0] < GROUP_TIMEOUT_S + 0.01, failed[0]

    # the aborted attempt drew no noise; the retry drew it once, then charged and released
    step_phases = [name for name, step in phases if step == KILL_STEP]
    gathers = [i for i, name in enumerate(step_phases) if name == "gather"]
    assert len(gathers) == 2, step_phases
    assert "noise" not in step_phases[: gathers[1]], step_phases
    assert step_phases[gathers[1] :].count("noise") == 1, step_phases
    assert step_phases.index("ledger") > gathers[1], step_phases

    # nothing of the aborted attempt is in the ledger or the release journal; each release's
    # commitment is the same in both, and every step's differs from the others'
    run_dir = tmp_path / "run"
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    charged = {r["step"]: r["release_sha256"] for r in ledger if "step" in r}
    journal = read_release_records(run_dir / "checkpoints")
    released = {r["step"]: r["release_sha256"] for r in journal}
    assert [r["step"] for r in ledger if "step" in r] == [0, 1, 2]
    assert [r["step"] for r in journal] == [0, 1, 2]
    assert charged == released and len(set(charged.values())) == 3
    assert cli.main(["ledger", "verify", str(run_dir)]) == 0
