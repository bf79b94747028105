"""Worker failures: a killed worker, a slow worker's late duplicate, bad partials, no replica."""

from __future__ import annotations

import threading

import pytest
import torch
from userdp.server.coordinator import CoordinatorSettings, StepAborted

from . import toy
from .harness import make_loopback, reference_params
from .standins import uls_strategy

ALL = ["shard-00000", "shard-00001", "shard-00002", "shard-00003"]


def _assert_matches_reference(loop, steps):
    expected = reference_params(uls_strategy(), loop.coordinator.population, steps)
    for name, value in loop.coordinator.params.items():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=1e-5)


def test_killed_worker_process_mid_step_completes_via_replica(tmp_path):
    kill_timer = []

    def hook(phase, step):
        if phase == "gather" and step == 1:
            timer = threading.Timer(0.3, loop.processes[0].kill)
            timer.start()
            kill_timer.append(timer)

    loop = make_loopback(tmp_path, fault_hook=hook)
    try:
        loop.add_process("a-proc", ALL, delay=1.0)  # wins ties: gets tasks first
        loop.coordinator.wait_for_workers()
        loop.add_worker("b-thread", ALL)
        loop.coordinator.wait_for_workers()
        reports = loop.coordinator.run(3)
    finally:
        loop.close()
    assert kill_timer and loop.processes[0].returncode is not None
    assert reports[1].failed_tasks > 0  # something was re-issued
    _assert_matches_reference(loop, 3)


def test_slow_worker_task_is_reissued_and_counted_once(tmp_path):
    settings = CoordinatorSettings(step_deadline_s=20, task_deadline_s=0.3)
    loop = make_loopback(tmp_path, settings=settings)
    try:
        loop.add_worker("a-slow", ALL, compute=toy.ToyCompute(delay_s=0.6))
        loop.add_worker("b-fast", ALL)
        loop.coordinator.wait_for_workers()
        reports = loop.coordinator.run(2)
    finally:
        loop.close()
    assert reports[0].failed_tasks > 0  # its step-0 task timed out and was re-issued
    _assert_matches_reference(loop, 2)


@pytest.mark.parametrize("corrupt", ["nan", "shape", "unclipped"])
def test_bad_partial_is_rejected_and_reissued(tmp_path, corrupt):
    loop = make_loopback(tmp_path)
    try:
        loop.add_worker("a-bad", ALL, compute=toy.ToyCompute(corrupt=corrupt))
        loop.add_worker("b-good", ALL)
        loop.coordinator.wait_for_workers()
        reports = loop.coordinator.run(2)
    finally:
        loop.close()
    assert all(r.failed_tasks > 0 for r in reports)
    _assert_matches_reference(loop, 2)


def test_step_without_any_holder_aborts_with_nothing_released_or_charged(tmp_path):
    settings = CoordinatorSettings(step_deadline_s=1.0, task_deadline_s=0.3, max_step_retries=0)
    loop = make_loopback(tmp_path, settings=settings)
    try:
        loop.add_worker("w0", ALL[:3])  # nobody holds shard-00003
        loop.wait_until_ready("w0")
        before = {n: t.clone() for n, t in loop.coordinator.params.items()}
        with pytest.raises(StepAborted):
            loop.coordinator.run(1)
    finally:
        loop.close()
    assert loop.coordinator.ledger.records == ()
    assert loop.coordinator.step == 0 and loop.coordinator.model_version == 0
    for name, value in loop.coordinator.params.items():
        assert torch.equal(value, before[name])


def test_stale_worker_is_resynced_not_trusted(tmp_path):
    loop = make_loopback(tmp_path)
    try:
        compute = toy.ToyCompute()
        client = loop.add_worker("a-returning", ALL, compute=compute)
        loop.add_worker("b-steady", ALL)
        loop.coordinator.wait_for_workers()
        loop.coordinator.run(1)
        client.stop()
        loop.threads[0].join(5)
        loop.coordinator.run(2)  # step 1 without it: its model is now one version behind
        stale_version = client.model_version
        assert stale_version < loop.coordinator.model_version == 2
        done_before = client.tasks_done
        loop.restart(client)
        loop.coordinator.run(4)
    finally:
        loop.close()
    assert compute.full_applies == 2  # initial sync + resync after coming back stale
    assert client.tasks_done > done_before  # and then trusted with tasks at the right version
    _assert_matches_reference(loop, 4)
