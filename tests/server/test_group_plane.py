"""The collective data plane over loopback: real gRPC control, a real gloo group of thread workers.

- noiseless steps end with the single-process reference model (every unit once, the reduced sum
  as the gathered one), and after the first step the model versions reach only the leader over
  gRPC while the other members receive them through the group;
- a member lost inside the reduce aborts the step (nothing charged), the retried step forms a new
  generation of the survivors, and the run ends with the reference model and one ledger entry
  per step;
- a reduced sum above the bound of the step's counted units is refused (the step aborts).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from userdp.clients.grpc_client import WorkerClient
from userdp.server.coordinator import CoordinatorSettings
from userdp.server.group_plane import GroupSettings
from userdp.server.registry import WorkerSession

from . import toy
from .harness import make_loopback, reference_params
from .standins import uls_strategy

# The group's timeout bounds a collective whose member died; the healthy collectives here move
# a few hundred bytes between threads of one process, far below it even on a loaded machine.
GROUP = GroupSettings(store_bind="127.0.0.1", timeout_s=60.0)
SETTINGS = CoordinatorSettings(
    step_deadline_s=120, task_deadline_s=60, worker_startup_s=300, max_step_retries=2
)


def _assert_reference(loop, steps: int) -> None:
    expected = reference_params(uls_strategy(), loop.coordinator.population, steps)
    for name, value in loop.coordinator.params.items():
        error = float((value - expected[name]).abs().max())
        # the workers reduce in float32 (the gRPC plane sums in float64): a few float32 ulps
        assert error <= 1e-5, f"{name!r} differs from the noiseless reference by {error:.3g}"
    steps_charged = [r["step"] for r in loop.coordinator.ledger.records]
    assert steps_charged == list(range(steps)), f"ledger holds steps {steps_charged}"


def _count_model_parts(monkeypatch) -> Counter:
    """(worker id, model version) → model parts the coordinator sends it over gRPC."""
    sent: Counter = Counter()
    original = WorkerSession.send

    def send(self, message) -> None:
        if message.WhichOneof("kind") == "model_part":
            sent[(self.worker_id, message.model_part.model_version)] += 1
        original(self, message)

    monkeypatch.setattr(WorkerSession, "send", send)
    return sent


@pytest.mark.parametrize(
    ("flat", "bucket_elements"),
    [(False, 1 << 20), (True, 1 << 20), (True, 1)],
    ids=["separate-sums-one-bucket", "flat-sums-one-bucket", "flat-sums-bucket-per-tensor"],
)
def test_collective_plane_matches_the_reference_and_broadcasts_through_the_group(
    tmp_path, monkeypatch, flat, bucket_elements
):
    """Separate sums are copied into a bucket of several tensors; sums laid out in one flat
    buffer (as the engines' accumulator lays them out) are reduced in place, the other held
    sums added in."""
    from userdp.clients import group_plane
    from userdp.proto import gloo

    monkeypatch.setattr(gloo, "BUCKET_ELEMENTS", bucket_elements)
    fills = []  # (held sums added to the buffer, the buffer was a held sum's own memory)
    original_fill = group_plane.WorkerGroup._fill

    def fill(self, buffer, bucket, held, written):
        fills.append((len(held), written))
        original_fill(self, buffer, bucket, held, written)

    monkeypatch.setattr(group_plane.WorkerGroup, "_fill", fill)
    sent = _count_model_parts(monkeypatch)
    # the survivors' reduce fails at the group's timeout: 20 s, as generous as the 10 s of the
    # other failure tests for a toy model's reduce on a busy machine
    group = GroupSettings(store_bind="127.0.0.1", timeout_s=20.0)
    loop = make_loopback(tmp_path, settings=SETTINGS, group=group)
    first = loop.coordinator.fleet.plane.generation + 1
    shards = sorted(loop.coordinator.population.shard_sha256)
    try:
        clients = [
            loop.add_worker(f"w{i}", shards[i::3], compute=toy.ToyCompute(flat=flat))
            for i in range(3)
        ]
        loop.coordinator.wait_for_workers()
        reports = loop.coordinator.run(3)
        for worker in ("w0", "w1", "w2"):
            loop.wait_until_ready(worker)
    finally:
        loop.close()
    _assert_reference(loop, 3)
    assert [r.failed_tasks for r in reports] == [0, 0, 0], [r.failed_tasks for r in reports]
    # flat sums are reduced in place (nothing copied), separate ones copied into the bucket; a
    # member that holds none reduces zeros (0, False)
    copied = [(n, written) for n, written in fills if n or written]
    assert copied and all(written == flat for _, written in copied), fills
    plane = loop.coordinator.fleet.plane
    assert plane.generation == first and plane.members == ("w0", "w1", "w2")
    for version in (1, 2, 3):  # the updates of steps 0, 1 and 2
        assert sent[("w0", version)] > 0, f"the leader got no version {version} over gRPC"
        for worker in ("w1", "w2"):
            assert sent[(worker, version)] == 0, (
                f"{worker} received version {version} over gRPC, not through the group"
            )
    assert [c.model_version for c in clients] == [3, 3, 3]


class FailsFirstTask(toy.ToyCompute):
    """A worker compute whose first task fails (its shard groups go to another holder)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.failed = False

    def compute(self, task):
        if not self.failed:
            self.failed = True
            raise RuntimeError("injected task failure")
        return super().compute(task)


@pytest.mark.parametrize("flat", [False, True], ids=["separate-sums", "flat-sums"])
def test_a_member_holding_two_sums_reduces_both(tmp_path, monkeypatch, flat):
    """Worker "b" fails its first task; its groups go to "a", which then holds two sums of the
    step: its reduce adds the second into the first (in place when flat) or copies both."""
    from userdp.clients import group_plane

    fills = []
    original_fill = group_plane.WorkerGroup._fill

    def fill(self, buffer, bucket, held, written):
        fills.append((self.runner.worker_id, len(held), written))
        original_fill(self, buffer, bucket, held, written)

    monkeypatch.setattr(group_plane.WorkerGroup, "_fill", fill)
    loop = make_loopback(tmp_path, settings=SETTINGS, group=GROUP)
    shards = sorted(loop.coordinator.population.shard_sha256)
    try:
        loop.add_worker("a", shards, compute=toy.ToyCompute(flat=flat))
        loop.add_worker("b", shards, compute=FailsFirstTask(flat=flat))
        loop.coordinator.wait_for_workers()
        reports = loop.coordinator.run(1)
    finally:
        loop.close()
    assert reports[0].failed_tasks == 1, "precondition: b's first task did not fail"
    two = ("a", 1, True) if flat else ("a", 2, False)
    assert two in fills, f"no reduce of two held sums in {fills}"
    _assert_reference(loop, 1)


class DyingMember(WorkerClient):
    """A real worker that dies when told to join its first reduce: its stream and its group
    end without taking part, as when the process is killed."""

    died = False

    def _group_message(self, kind, message, outbox) -> None:
        if kind == "group_reduce" and not DyingMember.died:
            DyingMember.died = True
            self._group.close()
            self._group = None
            self.stop()
            return
        super()._group_message(kind, message, outbox)


def test_a_member_lost_in_the_reduce_aborts_and_the_step_is_retried_by_a_new_generation(
    tmp_path,
):
    # the survivors' reduce fails at the group's timeout: 20 s, as generous as the 10 s of the
    # other failure tests for a toy model's reduce on a busy machine
    group = GroupSettings(store_bind="127.0.0.1", timeout_s=20.0)
    loop = make_loopback(tmp_path, settings=SETTINGS, group=group)
    first = loop.coordinator.fleet.plane.generation + 1
    shards = sorted(loop.coordinator.population.shard_sha256)
    DyingMember.died = False
    try:
        loop.add_worker("a", shards)  # every shard has two holders: the step survives a loss
        loop.add_worker("b", shards, client_class=DyingMember)
        loop.add_worker("c", shards)
        loop.coordinator.wait_for_workers()
        loop.coordinator.run(2)
    finally:
        loop.close()
    assert DyingMember.died, "precondition: the member did not die in the reduce"
    plane = loop.coordinator.fleet.plane
    assert plane.generation == first + 1 and plane.members == ("a", "c"), plane.members
    _assert_reference(loop, 2)


def test_a_reduced_sum_over_the_bound_aborts_the_step(tmp_path, monkeypatch):
    from userdp.clients import group_plane

    original = group_plane.WorkerGroup._fill

    def unclipped(self, buffer, bucket, held, written):
        original(self, buffer, bucket, held, written)
        buffer *= 100.0  # a worker whose sums were never clipped

    monkeypatch.setattr(group_plane.WorkerGroup, "_fill", unclipped)
    settings = CoordinatorSettings(
        step_deadline_s=120, task_deadline_s=60, worker_startup_s=300, max_step_retries=1
    )
    loop = make_loopback(tmp_path, settings=settings, group=GROUP)
    shards = sorted(loop.coordinator.population.shard_sha256)
    try:
        loop.add_worker("a", shards)
        loop.add_worker("b", shards)
        loop.coordinator.wait_for_workers()
        from userdp.server.fleet import StepAborted

        with pytest.raises(StepAborted, match="exceeds count"):
            loop.coordinator.run(1)
    finally:
        loop.close()
    assert list(loop.coordinator.ledger.records) == [], "an aborted step was charged"
    assert torch.equal(loop.coordinator.params["w"], toy.initial_params()["w"])


def test_a_coordinator_crash_between_the_ledger_and_the_update_resumes_consistently(tmp_path):
    """The coordinator dies after step 1 is charged (ledger appended) but before its update is
    applied or broadcast. A new coordinator (a new store, so a new group) resumes from the
    checkpoint: step 1 is replayed, not charged again, the workers are resynced, and the run
    ends with the noiseless reference and one ledger entry per step."""

    class Crash(Exception):
        pass

    def crash(phase, step):
        if (phase, step) == ("update", 1):
            raise Crash()

    loop = make_loopback(tmp_path, settings=SETTINGS, group=GROUP, fault_hook=crash)
    shards = sorted(loop.coordinator.population.shard_sha256)
    try:
        loop.add_worker("a", shards[::2])
        loop.add_worker("b", shards[1::2])
        loop.coordinator.wait_for_workers()
        with pytest.raises(Crash):
            loop.coordinator.run(3)
    finally:
        loop.close()
    charged = [r["step"] for r in loop.coordinator.ledger.records]
    assert charged == [0, 1], f"precondition: the crash came after step 1's append ({charged})"
    loop = make_loopback(tmp_path, settings=SETTINGS, group=GROUP)
    try:
        assert loop.coordinator.step == 1, "the charged, unreleased step 1 must be replayed"
        loop.add_worker("a", shards[::2])
        loop.add_worker("b", shards[1::2])
        loop.coordinator.wait_for_workers()
        loop.coordinator.run(3)
    finally:
        loop.close()
    _assert_reference(loop, 3)


class HangingMember(WorkerClient):
    """A real worker that stays connected but never joins its first reduce (a hung process):
    the other members' reduce can only end by the group's timeout."""

    hung = False

    def _group_message(self, kind, message, outbox) -> None:
        if kind == "group_reduce" and not HangingMember.hung:
            HangingMember.hung = True
            return
        super()._group_message(kind, message, outbox)


def test_a_member_that_never_joins_the_reduce_fails_it_at_the_groups_timeout(tmp_path):
    # 10 s: what the others wait in the hung reduce; the healthy rendezvous and collectives of
    # three threads take milliseconds, so a loaded machine does not reach it
    group = GroupSettings(store_bind="127.0.0.1", timeout_s=10.0)
    loop = make_loopback(tmp_path, settings=SETTINGS, group=group)
    first = loop.coordinator.fleet.plane.generation + 1
    shards = sorted(loop.coordinator.population.shard_sha256)
    HangingMember.hung = False
    try:
        loop.add_worker("a", shards)
        loop.add_worker("b", shards, client_class=HangingMember)
        loop.add_worker("c", shards)
        loop.coordinator.wait_for_workers()
        loop.coordinator.run(2)
    finally:
        loop.close()
    assert HangingMember.hung, "precondition: the member did not hang"
    plane = loop.coordinator.fleet.plane
    assert plane.generation == first + 1 and plane.members == ("a", "b", "c")
    _assert_reference(loop, 2)


def test_a_worker_that_cannot_join_the_group_is_left_out_and_the_others_train(
    tmp_path, monkeypatch
):
    """Worker "b" cannot open its gloo device (a wrong interface): its joins fail at once, the
    others' time out waiting for it. After two failed joins it is left out; the step, retried,
    is done by the other two, which hold every shard."""
    import threading

    from userdp.proto import gloo

    device = gloo.device
    failures = []

    def device_unless_b():
        if threading.current_thread().name == "userdp-group-b":  # b's group thread
            failures.append(1)
            raise RuntimeError("no such interface 'eth9'")
        return device()

    monkeypatch.setattr(gloo, "device", device_unless_b)
    # 10 s: what the others wait for "b" at each failed rendezvous (two of them)
    group = GroupSettings(store_bind="127.0.0.1", timeout_s=10.0)
    loop = make_loopback(tmp_path, settings=SETTINGS, group=group)
    shards = sorted(loop.coordinator.population.shard_sha256)
    try:
        for worker in ("a", "b", "c"):
            loop.add_worker(worker, shards)
        loop.coordinator.wait_for_workers()
        loop.coordinator.run(2)
    finally:
        loop.close()
    plane = loop.coordinator.fleet.plane
    assert len(failures) == 2 and plane.excluded == {"b"}, (failures, plane.excluded)
    assert plane.members == ("a", "c")
    _assert_reference(loop, 2)


def test_a_reduce_drops_the_sums_it_does_not_name_and_keeps_later_gathers():
    """A worker keeps only what a later reduce can name: the reduce of gather g of step s takes
    the named sums and drops every other sum of s's gathers up to g and of earlier steps (late
    results, aborted gathers), and keeps the sums of s's later gathers (a reduce the coordinator
    gave up can reach the worker after the retried gather's tasks did)."""
    from userdp.clients.task_runner import TaskRunner
    from userdp.proto import userdp_v1_pb2 as pb
    from userdp.proto.results import TaskSum

    runner = TaskRunner("w", compute=None, session_chunk_bytes=1 << 20)
    held = (("2.0", 2, 0), ("3.0", 3, 0), ("3.1", 3, 0), ("3r1.0", 3, 1), ("3r2.0", 3, 2))
    for task_id, step, gather in held:
        task = pb.Task(task_id=task_id, step=step, gather=gather)
        runner._hold(task, TaskSum({"w": torch.ones(2) * step}))
    assert sorted(runner._held) == ["3.0/0", "3.1/0", "3r1.0/0", "3r2.0/0"]  # step 2's dropped
    # the abandoned first gather's reduce, arriving late: the retries' sums survive it
    assert runner.take_held(3, 0, ["3.0/0"]) is not None
    assert sorted(runner._held) == ["3r1.0/0", "3r2.0/0"], "a later gather's sum was dropped"
    taken = runner.take_held(3, 1, ["3r1.0/0"])
    assert len(taken) == 1 and torch.equal(taken[0]["w"], torch.full((2,), 3.0))
    assert sorted(runner._held) == ["3r2.0/0"]
    assert runner.take_held(3, 2, ["3.1/0"]) is None, "a dropped sum was found again"
    assert runner._held == {}, "sums of the reduced gather it did not name are still held"
