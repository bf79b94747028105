"""The fleet of the collective data plane: :class:`CollectiveFleet` runs the
:class:`~userdp.server.fleet.Fleet`'s gather and broadcast through the workers' process group
(:mod:`userdp.server.group_plane`, which says what happens when and why).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Mapping

import torch
from userdp.proto.layout import TensorLayout
from userdp.server.aggregation import StepGather
from userdp.server.fleet import Fleet, StepAborted
from userdp.server.group_plane import GroupPlane
from userdp.server.group_root import RootReduce
from userdp.server.registry import (
    Event,
    GroupJoinedEvent,
    ModelAcked,
    TaskFailedEvent,
    WorkerJoined,
    WorkerLost,
    WorkerSession,
)


class CollectiveFleet(Fleet):
    """A :class:`~userdp.server.fleet.Fleet` whose workers hold their sums, reduce them in their
    group and pass each version on (see :mod:`userdp.server.group_plane`)."""

    holds_sums = True

    def __init__(self, *args, plane: GroupPlane, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.plane = plane
        self.reduce_seconds = 0.0
        """The last reduce: from the members' ``GroupReduce`` to the checked reduced sum."""
        self.reduce_phases: dict[str, float] = {}
        """Its parts (seconds): waiting for the rendezvous, the failure count, the buckets'
        reduce, the gather's checks."""

    def _before_gather(self) -> None:
        self.plane.form(self.plane.candidates(self.eligible()), self._rendezvous_s())

    def _rendezvous_s(self) -> float:
        """How long the coordinator waits for the members to join its reduce group: as long as
        it would wait for the step's reduce."""
        return self.settings.step_deadline_s + 2 * self.plane.settings.timeout_s

    def _after_gather(self, collect: StepGather, deadline: float) -> None:
        self._reduce(collect, deadline)

    def _task_workers(self) -> dict[str, WorkerSession]:
        """Only the group's members can join its reduce."""
        return {w: s for w, s in self.eligible().items() if w in self.plane.members}

    def _ack_wait(self) -> float:
        """A version takes two hops (to the leader, through the group): members still receiving
        it when the step starts would change the membership."""
        return max(self.settings.ack_wait_s, self.plane.settings.timeout_s)

    def handle(self, event: Event, collect: StepGather | None) -> None:
        self._group_event(event)
        if not isinstance(event, GroupJoinedEvent):
            super().handle(event, collect)

    def _reduce(self, collect: StepGather, deadline: float) -> None:
        """The collective data plane: the members reduce their accepted held sums straight to
        the coordinator (:mod:`userdp.server.group_root`) with each member's norm; the sum,
        checked as a whole and member by member, completes ``collect``; :class:`StepAborted` (and a broken generation) when a member holding sums
        is lost, a member cannot contribute, a collective fails, or the sum is bad or late.
        Members lost before the reduce that hold none are left out by a new generation."""
        plane, held = self.plane, collect.held_by()
        if not plane.healthy:
            raise StepAborted(f"step {collect.step}: the workers' group failed before the reduce")
        live = {w: s for w, s in self._member_sessions().items() if s is not None and s.alive}
        lost = [w for w in plane.members if w not in live]
        if any(held.get(w) for w in lost):
            plane.broken(f"member(s) {lost} lost before the reduce")
            raise StepAborted(f"step {collect.step}: group member(s) {lost} lost before the reduce")
        if lost:
            plane.broken(f"member(s) {lost} lost; they held no sums of step {collect.step}")
            plane.form(live, self._rendezvous_s())
        if not plane.members:  # an empty cohort and no worker: nothing to reduce
            zeros = {n: torch.zeros(t.shape) for n, t in collect.template_tensors().items()}
            problem = collect.offer_reduced(zeros, {})
            if problem is None:
                return
            raise StepAborted(f"step {collect.step}: {problem}")
        started = time.perf_counter()
        metas = TensorLayout.of_tensors(collect.template_tensors(), "float32").metas()
        task_id, messages = plane.reduce_messages(
            collect.step, collect.retry, self.model_version, held, metas
        )
        for worker, message in messages.items():
            live[worker].send(message)
        # the rendezvous and each collective are bounded by the group's timeout
        deadline = max(deadline, time.monotonic() + 2 * plane.settings.timeout_s)
        wait = _ReduceWait(self, collect, task_id, deadline)
        root, reduce = plane.root, None
        phases = self.reduce_phases = {}
        problem = wait.until(root.ready) or root.error
        phases["rendezvous"] = time.perf_counter() - started
        if not problem:
            reduce = RootReduce(root.group, metas)
            problem = wait.until(reduce.completed) or reduce.problem()
            phases["failure count"] = time.perf_counter() - started - sum(phases.values())
        if not problem and reduce.failures.item():
            failed = int(reduce.failures.item())
            problem = f"{failed} member(s) could not contribute their held sums"
        if not problem:
            reduce.start_buckets()
            problem = wait.until(reduce.completed) or reduce.problem()
            phases["reduce"] = time.perf_counter() - started - sum(phases.values())
        if not problem:
            # member r's norm in slot r: the messages went to the members in rank order
            norms = dict(zip(messages, reduce.member_norms.tolist(), strict=True))
            problem = collect.offer_reduced(reduce.sums, norms)
        if problem is None:
            self.reduce_seconds = time.perf_counter() - started
            phases["check"] = self.reduce_seconds - sum(phases.values())
            return
        if reduce is not None:
            reduce.abandon()
        plane.broken(problem)
        raise StepAborted(f"step {collect.step}: the workers' reduce failed: {problem}")

    def _member_sessions(self) -> dict[str, WorkerSession | None]:
        """The current sessions of the group's members (None: gone; a session other than the
        one asked to join counts as gone)."""
        plane = self.plane
        out: dict[str, WorkerSession | None] = {}
        for worker in plane.members:
            session = self.registry.get(worker)
            out[worker] = (
                session
                if session is not None and session.session_id == plane.sessions.get(worker)
                else None
            )
        return out

    def _group_broadcast(
        self, targets: list[WorkerSession], trainable: Mapping[str, object]
    ) -> tuple[str, ...]:
        """Announce the version to the group's members when the group can carry it (healthy,
        every member live, the leader a target); returns the members (leader first) or ()."""
        plane = self.plane
        if plane is None or not plane.healthy:
            return ()
        sessions = self._member_sessions()
        if any(s is None or not s.alive for s in sessions.values()) or plane.leader not in {
            s.worker_id for s in targets
        }:
            plane.broken("a member is lost or the leader missed the last version")
            return ()
        messages = plane.model_messages(
            self.model_version, TensorLayout.of_tensors(trainable).metas()
        )
        for worker, message in messages.items():
            sessions[worker].send(message)
            sessions[worker].sent_version = self.model_version
        return plane.members

    def _group_event(self, event: Event) -> None:
        """What an event means for the workers' group: a failed join, a member lost, replaced
        or rejoined, or a member that could not apply a version break the generation."""
        plane = self.plane
        worker = event.session.worker_id
        if worker not in plane.members:
            return
        if isinstance(event, GroupJoinedEvent):
            plane.joined(worker, event.generation, event.ok, event.error)
        elif isinstance(event, WorkerLost | WorkerJoined):
            plane.broken(
                f"member {worker} {'lost' if isinstance(event, WorkerLost) else 'rejoined'}"
            )
        elif isinstance(event, ModelAcked) and event.rejected:
            plane.broken(f"member {worker} could not apply a model version")


class _ReduceWait:
    """The coordinator's loop while its reduce's collectives run: events are handled as in the
    gather; a member's ``TaskFailed`` for the reduce, a lost member or a broken generation ends
    the wait at once (the reduce cannot give the step's sum; collectives still in flight are
    waited out by :meth:`RootReduce.abandon`)."""

    def __init__(
        self, fleet: CollectiveFleet, collect: StepGather, task_id: str, deadline: float
    ) -> None:
        self.fleet, self.collect, self.task_id, self.deadline = fleet, collect, task_id, deadline
        self.generation = fleet.plane.generation

    def until(self, done: Callable[[], bool]) -> str:
        """Handle events until ``done()``; returns why the reduce cannot end well ("" = done)."""
        fleet, plane = self.fleet, self.fleet.plane
        while not done():
            if time.monotonic() > self.deadline:
                return "the reduce did not end within the step's deadline"
            fleet.registry.reap_silent(fleet.settings.heartbeat_timeout_s)
            try:
                event = fleet.registry.events.get(timeout=0.005)
            except queue.Empty:
                continue
            if isinstance(event, TaskFailedEvent) and event.task_id == self.task_id:
                return f"{event.session.worker_id}: {event.reason}"
            fleet.handle(event, self.collect)
            if not plane.healthy or plane.generation != self.generation:
                return "the group failed (see above)"
        return ""
