"""Gathering a step over the connected workers: dispatch, events, retries, resyncs, broadcast.

:class:`Fleet` is the coordinator's view of its workers (the sessions of
:mod:`userdp.server.registry`) together with the model version they must hold to get tasks. The
coordinator (:mod:`userdp.server.coordinator`) owns one and calls it at three points of a step:

- :meth:`Fleet.sync` (phase ``sync``): handle joins and acks, resync workers that missed a model
  version, and give workers a moment to acknowledge the current version so the work spreads over
  all of them.
- :meth:`Fleet.gather` (phase ``gather``): batch the step's pending shard groups into one task per
  live, in-sync worker holding them (replicas spread the load) and feed every result to the
  step's :class:`~userdp.server.aggregation.StepGather`, which accepts it exactly once. When a
  task's worker dies, times out, refuses it or sends a bad partial, its shard groups are
  re-issued, with a higher attempt number, to other holders. When the step cannot complete by
  its deadline, or a task fails ``max_attempts`` times, the outstanding tasks are cancelled and
  :class:`StepAborted` is raised: nothing was released or charged.
- :meth:`Fleet.broadcast` (phase ``broadcast``): the new version's tensors to every worker that
  held the previous one, streamed while they are encoded.

Where the data planes differ the fleet asks its sum plane (:mod:`userdp.server.sum_plane`):
which workers get tasks, what a gather needs before its first task and once every group is done,
what an event means to the plane, and who gets a version over gRPC. Under the gRPC plane every
result carries its sum and every version streams from here; under the collective plane
(:mod:`userdp.server.group_plane`) the gather first makes the step's workers one process group
and gives tasks to its members only, which hold their sums; once every group is done the members
reduce the accepted sums straight to the coordinator, and that one reduced sum completes the
gather; and a broadcast sends the version to the group's leader, which passes it on through the
group.

Between steps :meth:`Fleet.pump_events` handles queued events and :meth:`Fleet.wait_for_workers`
waits until every shard has an in-sync holder. A worker whose model version is not the current
one is resynced with the full model (at most :data:`MAX_RESYNCS` times without an acknowledgement),
never trusted. The fleet logs under the coordinator's logger name (``userdp.server.coordinator``):
operators follow one logger for the step loop.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto.codec import task_proto
from userdp.server.aggregation import StepGather
from userdp.server.planning import assign_groups
from userdp.server.publisher import ModelPublisher
from userdp.server.registry import (
    Event,
    ModelAcked,
    ResultReceived,
    TaskFailedEvent,
    WorkerJoined,
    WorkerLost,
    WorkerRegistry,
    WorkerSession,
)
from userdp.server.startup import StartupWait, WorkerProgress
from userdp.server.sum_plane import SumArrival, SumPlane
from userdp.strategies.base import TaskSpec

if TYPE_CHECKING:  # the coordinator imports this module
    from userdp.server.coordinator import CoordinatorSettings

log = logging.getLogger("userdp.server.coordinator")

MAX_RESYNCS = 3
DATA_CHECK_S = 1.0
"""How often a gathering step checks that the run's data is still there (``data_check``)."""


class StepAborted(RuntimeError):
    """The step could not gather every task in time; nothing was released or charged."""


class Fleet:
    """The workers of one coordinator and the current model version (see the module docstring).

    ``shards``: every shard of the population (the start-up wait needs a holder of each);
    ``settings``: the coordinator's deadlines, attempts and waits; ``plane``: how sums and
    versions travel (:mod:`userdp.server.sum_plane`)."""

    def __init__(
        self,
        registry: WorkerRegistry,
        publisher: ModelPublisher,
        shards: frozenset[str],
        settings: CoordinatorSettings,
        plane: SumPlane,
        data_check: Callable[[], None] | None = None,
    ) -> None:
        """``data_check``: raises when the run's data is gone (the shard folder deleted or
        moved); called as each step starts and about every :data:`DATA_CHECK_S` while it
        gathers, so the run stops before that step releases anything."""
        self.registry = registry
        self.publisher = publisher
        self.shards = shards
        self.settings = settings
        self.plane = plane
        self.data_check = data_check
        self._data_checked = -math.inf
        self.model_version = 0
        """The version a worker must hold to be given tasks."""
        self._resyncs: dict[WorkerSession, int] = defaultdict(int)

    # ---- one step -------------------------------------------------------------------------------

    def sync(self) -> None:
        """Before a step: handle queued events, resync every worker that was not sent the
        current version (e.g. it joined mid-broadcast), and wait up to ``ack_wait_s`` for the
        workers that were sent it to acknowledge it."""
        self._check_data(force=True)
        self.pump_events()
        for session in self.registry.sessions():
            if session.sent_version != self.model_version:
                self.resync(session)
        self._await_acks(self.plane.ack_wait_s(self.settings))

    def gather(self, collect: StepGather, spec: TaskSpec) -> None:
        """Run the step's tasks until ``collect`` is complete; :class:`StepAborted` when it
        cannot be (see the module docstring)."""
        deadline = time.monotonic() + self.settings.step_deadline_s
        self.plane.start_gather(self.eligible(), self.settings)
        while not collect.complete():
            now = time.monotonic()
            if now > deadline:
                self._cancel_all(collect)
                raise StepAborted(
                    f"step {collect.step}: {len(collect.pending()) + len(collect.outstanding())} "
                    f"task(s) not done after {self.settings.step_deadline_s:.0f}s"
                )
            try:
                self._check_data()
            except Exception:
                self._cancel_all(collect)
                raise
            self.registry.reap_silent(self.settings.heartbeat_timeout_s, now)
            for task_id, attempt, worker, issued_at in collect.outstanding():
                if now - issued_at > self.settings.task_deadline_s:
                    log.warning("task %s attempt %d on %s timed out", task_id, attempt, worker)
                    collect.fail(task_id, attempt, "timeout")
                    self._send_cancel(worker, task_id, attempt)
            self._dispatch(collect, spec)
            if collect.complete():
                break
            try:
                event = self.registry.events.get(timeout=0.02)
            except queue.Empty:
                continue
            self.handle(event, collect)
        self.plane.complete_gather(self, collect, deadline)

    def _check_data(self, force: bool = False) -> None:
        """Run ``data_check`` (at most every :data:`DATA_CHECK_S` unless ``force``)."""
        now = time.monotonic()
        if self.data_check is None or (not force and now - self._data_checked < DATA_CHECK_S):
            return
        self._data_checked = now
        self.data_check()

    def broadcast(self, trainable: Mapping[str, object]) -> None:
        """Publish the current version's ``trainable`` tensors and stream them, as they are
        encoded, to every worker that was sent the version before (it is eligible again once it
        acknowledges); the others are resynced at the next :meth:`sync`. The plane says which of
        them get it over gRPC from here (under the collective data plane with a working group,
        only the leader of the members, which passes it on through the group)."""
        targets = [s for s in self.registry.sessions() if s.sent_version == self.model_version - 1]
        direct = self.plane.broadcast(self, targets, trainable)
        for session in targets:
            session.sent_version = self.model_version

        def send(message: pb.CoordinatorMessage) -> None:
            for session in direct:
                session.send(message)

        self.publisher.publish(self.model_version, trainable, sink=send)

    def eligible(self) -> dict[str, WorkerSession]:
        """The sessions that may be given tasks, by worker id: live, not draining, holding the
        current version."""
        return {
            s.worker_id: s
            for s in self.registry.sessions()
            if not s.draining and s.model_version == self.model_version
        }

    def _dispatch(self, collect: StepGather, spec: TaskSpec) -> None:
        """Batch pending shard groups into one task per chosen worker and send them."""
        pending = collect.pending()
        if not pending:
            return
        eligible = self.plane.task_workers(self.eligible())
        holders = {w: s.shards for w, s in eligible.items()}
        load: dict[str, int] = defaultdict(int)
        for task_id, _, worker, _ in collect.outstanding():
            load[worker] += len(collect.task_units(task_id))
        assigned, _ = assign_groups(pending, holders, load, collect.failed_workers)
        for worker, groups in assigned.items():
            task_id, attempt = collect.issue(worker, [g.group_id for g in groups], time.monotonic())
            if attempt >= self.settings.max_attempts:
                self._cancel_all(collect)
                raise StepAborted(f"shard groups of task {task_id} failed {attempt} attempts")
            task = task_proto(
                spec,
                collect.step,
                task_id,
                attempt,
                self.model_version,
                collect.task_units(task_id),
                self.settings.task_deadline_s,
                hold=self.plane.arrival is SumArrival.REDUCED,
                gather=collect.retry,
            )
            eligible[worker].send(pb.CoordinatorMessage(task=task))

    def _send_cancel(self, worker_id: str, task_id: str, attempt: int) -> None:
        session = self.registry.get(worker_id)
        if session is not None:
            session.send(
                pb.CoordinatorMessage(cancel=pb.CancelTask(task_id=task_id, attempt=attempt))
            )

    def _cancel_all(self, collect: StepGather) -> None:
        for task_id, attempt, worker, _ in collect.outstanding():
            self._send_cancel(worker, task_id, attempt)

    # ---- events ---------------------------------------------------------------------------------

    def pump_events(self, timeout: float = 0.0) -> None:
        """Handle queued events outside a step (joins, acks, resyncs)."""
        self.registry.reap_silent(self.settings.heartbeat_timeout_s)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                event = (
                    self.registry.events.get(timeout=max(remaining, 0.0))
                    if remaining > 0
                    else self.registry.events.get_nowait()
                )
            except queue.Empty:
                return
            self.handle(event, None)

    def _await_acks(self, timeout_s: float) -> None:
        """Let workers that were sent the current model acknowledge it before tasks go out, so
        the step's work spreads over all of them (bounded by ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            waiting = [
                s
                for s in self.registry.sessions()
                if s.sent_version == self.model_version and s.model_version != self.model_version
            ]
            if not waiting:
                return
            self.pump_events(0.005)

    def wait_for_workers(
        self,
        timeout_s: float | None = None,
        *,
        on_progress: Callable[[list[WorkerProgress]], None] | None = None,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Wait until every shard has an in-sync holder, while starting workers make progress
        (:mod:`~userdp.server.startup`); raises :class:`~userdp.server.startup.WorkerStartupError`
        after ``timeout_s`` (default ``settings.worker_startup_s``) or when every starting worker
        has been silent for ``settings.worker_stall_s``. ``on_progress`` receives the starting
        workers about once a second; ``check`` may raise to end the wait (e.g. a worker process
        exited)."""
        wait = StartupWait(
            needed=self.shards,
            startup_s=self.settings.worker_startup_s if timeout_s is None else timeout_s,
            stall_s=self.settings.worker_stall_s,
            started=time.monotonic(),
        )
        shown = -math.inf
        while True:
            done, starting = wait.check(
                self.eligible(), self.registry.sessions(), self.registry.startup()
            )
            if done:
                return
            if check is not None:
                check()
            if on_progress is not None and time.monotonic() - shown >= 1.0:
                shown = time.monotonic()
                on_progress(starting)
            self.pump_events(0.05)

    def handle(self, event: Event, collect: StepGather | None) -> None:
        """Act on one event, after the plane (:meth:`SumPlane.observe
        <userdp.server.sum_plane.SumPlane.observe>`); ``collect`` is the running step's gather
        (None between steps)."""
        self.plane.observe(event)
        if isinstance(event, ResultReceived):
            if collect is None:
                return
            if event.result is None:
                if collect.fail(event.task_id, event.attempt, event.error or "bad result"):
                    log.warning(
                        "rejected %s attempt %d from %s: %s",
                        event.task_id,
                        event.attempt,
                        event.session.worker_id,
                        event.error,
                    )
                return
            verdict = collect.offer(event.result)
            if not verdict.accepted:
                level = logging.WARNING if verdict.reissue else logging.INFO
                log.log(
                    level,
                    "%s %s attempt %d from %s: %s",
                    "rejected" if verdict.reissue else "discarded",
                    event.task_id,
                    event.attempt,
                    event.session.worker_id,
                    verdict.reason,
                )
        elif isinstance(event, TaskFailedEvent):
            if collect is not None and collect.fail(event.task_id, event.attempt, event.reason):
                log.warning(
                    "task %s attempt %d failed on %s: %s",
                    event.task_id,
                    event.attempt,
                    event.session.worker_id,
                    event.reason,
                )
                if event.reason.startswith("stale model"):
                    self.resync(event.session, force=True)
        elif isinstance(event, WorkerLost):
            self._resyncs.pop(event.session, None)
            failed = collect.fail_worker(event.session.worker_id) if collect is not None else []
            if failed:
                log.warning(
                    "worker %s lost (%s); re-issuing %s",
                    event.session.worker_id,
                    event.reason,
                    failed,
                )
            else:
                log.warning("worker %s lost (%s)", event.session.worker_id, event.reason)
        elif isinstance(event, WorkerJoined):
            self.resync(event.session)
        elif isinstance(event, ModelAcked):
            if event.rejected:
                self.resync(event.session, force=True)
            elif event.model_version == self.model_version:
                self._resyncs.pop(event.session, None)

    def resync(self, session: WorkerSession, force: bool = False) -> None:
        """Send the full model to a worker whose version is not the current one (``force``:
        even when it claims the current one)."""
        if not session.alive or (session.model_version == self.model_version and not force):
            return
        if self._resyncs[session] >= MAX_RESYNCS:
            log.error(
                "worker %s failed %d resyncs; not sending more", session.worker_id, MAX_RESYNCS
            )
            return
        self._resyncs[session] += 1
        session.model_version = -1
        version, messages = self.publisher.full()
        session.sent_version = version
        session.send_many(messages)
        log.info("resyncing worker %s to model version %d", session.worker_id, version)
