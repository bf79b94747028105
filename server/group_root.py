"""The coordinator's rank in one generation of the workers' group, and that generation's reduces
(the collective data plane, :mod:`userdp.server.group_plane`).

Each generation of the workers' group has a *reduce group* (:mod:`userdp.proto.gloo`) whose
rank 0 is the coordinator: the members reduce their accepted held sums straight into the
coordinator's buffers, so the sum reaches it as raw float32 bytes, with no gRPC stream, no
protobuf copy and no worker that must send it alone. One :class:`GroupRoot` owns the
coordinator's rank of one generation and runs every reduce of it:

- **The rank.** It is built on a thread of its own, over a store connection of its own, while
  the coordinator's loop goes on handling events. The thread first waits, polling the store,
  until every member said it arrived (:data:`userdp.proto.gloo.ARRIVED_PREFIX`), as long as the
  coordinator would wait for the step's reduce (a member may first have to finish what an
  earlier generation asked of it, each part bounded by the group's timeout); the wait ends early
  when the generation is replaced or the process is exiting (a rendezvous blocked inside gloo
  cannot be left, and would abort the process at exit). Then it builds its rank, with the
  members already waiting; its collectives fail after the group's timeout, as the members' do.
- **A reduce** (:meth:`GroupRoot.reduce`). Each member is told which of its held sums were
  accepted (``GroupReduce``). Once the rank is built: the failure count all-reduced with the
  members, then one gloo reduce per bucket into the sum's own tensors, then one of the members'
  norms (each member's norm in its rank's slot); the step's
  :class:`~userdp.server.aggregation.StepGather` checks the sum as a whole and member by member.
  Every collective is issued asynchronously; the coordinator handles events between polls, so a
  member lost or a failure reported meanwhile is seen at once. A reduce given up while
  collectives are still in flight is handed to a thread that waits them out (each ends by the
  group's timeout at the latest), so the coordinator never blocks on a dead member.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from userdp.proto import gloo
from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto.collectives import start_failure_count
from userdp.proto.layout import TensorLayout
from userdp.server.registry import TaskFailedEvent, WorkerSession

if TYPE_CHECKING:  # types only: the plane is given the fleet and the gather
    from userdp.server.aggregation import StepGather
    from userdp.server.fleet import Fleet

log = logging.getLogger("userdp.server.coordinator")


class GroupRoot:
    """The coordinator's rank 0 of one generation's reduce group, and its reduces (see the
    module docstring). ``members``: the generation's members in rank order; ``rendezvous_s``:
    how long the rank waits for them to arrive."""

    def __init__(
        self,
        address: tuple[str, int],
        prefix: str,
        members: tuple[str, ...],
        timeout_s: float,
        rendezvous_s: float,
        generation: int,
    ) -> None:
        self.members, self.generation, self.timeout_s = members, generation, timeout_s
        self.group: dist.ProcessGroupGloo | None = None
        self.error = ""
        self.phases: dict[str, float] = {}
        """The last reduce's parts (seconds), from the members' ``GroupReduce`` on: waiting for
        the rendezvous, the failure count, the buckets' reduce, the gather's checks."""
        self._ready = threading.Event()
        self._cancelled = threading.Event()
        threading.Thread(
            target=self._join,
            args=(address, prefix, len(members) + 1, timeout_s, rendezvous_s),
            name=f"userdp-group-root-{generation}",
            daemon=True,
        ).start()

    def _join(
        self,
        address: tuple[str, int],
        prefix: str,
        size: int,
        timeout_s: float,
        rendezvous_s: float,
    ) -> None:
        try:
            # a connection of its own: a wait for an earlier generation's members must not hold
            # up this one's
            store = gloo.client_store(*address, timeout_s)
            members = list(range(1, size))
            gloo.wait_arrived(store, prefix, members, rendezvous_s, self._cancelled.is_set)
            gloo.arrive(store, prefix, 0)
            self.group = gloo.group(store, prefix + gloo.REDUCE_PREFIX, 0, size, timeout_s)
        except Exception as exc:
            self.error = f"the coordinator could not join the reduce group: {exc}"
        finally:
            self._ready.set()

    def ready(self) -> bool:
        """The rendezvous ended (:attr:`group` set, or :attr:`error` says why not)."""
        return self._ready.is_set()

    def cancel(self) -> None:
        """The generation was replaced: stop waiting for its members."""
        self._cancelled.set()

    def reduce(
        self,
        fleet: Fleet,
        collect: StepGather,
        sessions: Mapping[str, WorkerSession],
        task_id: str,
        deadline: float,
        current: Callable[[], bool],
    ) -> str:
        """The members (``sessions``: their live sessions) reduce their accepted held sums of
        ``collect`` to this rank with each member's norm, and ``collect`` takes them; returns why
        it could not ("" = taken). The coordinator handles events meanwhile; the reduce ends as
        soon as it cannot end well: a member's ``TaskFailed`` for ``task_id``, ``current()``
        false (the generation failed), or past ``deadline`` (at least twice the group's
        timeout from now: the rendezvous and each collective are bounded by it)."""
        started = time.perf_counter()
        metas = TensorLayout.of_tensors(collect.template_tensors(), "float32").metas()
        held = collect.held_by()
        for worker in self.members:
            sessions[worker].send(
                self._reduce_message(collect, fleet.model_version, task_id, held, metas, worker)
            )
        deadline = max(deadline, time.monotonic() + 2 * self.timeout_s)
        wait = _ReduceWait(fleet, collect, task_id, deadline, current)
        reduce, phases = None, {}
        self.phases = phases
        problem = wait.until(self.ready) or self.error
        phases["rendezvous"] = time.perf_counter() - started
        if not problem:
            reduce = _RootCollectives(self.group, metas)
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
            # member r's norm in slot r: the members are in rank order
            norms = dict(zip(self.members, reduce.member_norms.tolist(), strict=True))
            problem = collect.offer_reduced(reduce.sums, norms)
        if problem is None:
            phases["check"] = time.perf_counter() - started - sum(phases.values())
            return ""
        if reduce is not None:
            reduce.abandon()
        return problem

    def _reduce_message(
        self,
        collect: StepGather,
        model_version: int,
        task_id: str,
        held: Mapping[str, list[str]],
        metas: list,
        worker: str,
    ) -> pb.CoordinatorMessage:
        """``worker``'s ``GroupReduce``: the held sums of ``collect``'s gather it adds."""
        return pb.CoordinatorMessage(
            group_reduce=pb.GroupReduce(
                step=collect.step,
                generation=self.generation,
                task_id=task_id,
                attempt=0,
                model_version=model_version,
                held=held.get(worker, []),
                tensors=metas,
                gather=collect.retry,
            )
        )


class _RootCollectives:
    """The root's collectives of one reduce (see the module docstring): :meth:`completed` says
    when the ones issued so far have ended, :meth:`problem` whether one failed."""

    def __init__(self, group: dist.ProcessGroupGloo, metas: Sequence) -> None:
        self.group = group
        self.layout = TensorLayout.of_metas(metas)
        self.failures, counted = start_failure_count(False, group)
        self.sums: dict[str, torch.Tensor] = {}
        self.member_norms = torch.zeros(group.size() - 1, dtype=torch.float64)
        """‖member r's sum‖ at index r (each member fills its own slot, the others are 0)."""
        self._works = [counted]

    def completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def problem(self) -> str:
        """The first failed collective's error ("" = none failed; call once completed)."""
        for work in self._works:
            try:
                work.wait()
            except Exception as exc:
                return f"the reduce's collective failed at the coordinator: {exc}"
        return ""

    def start_buckets(self) -> None:
        """Issue one reduce per bucket into zeroed float32 buffers, which become :attr:`sums`,
        then the reduce of the members' norms (:attr:`member_norms`)."""
        for bucket in gloo.buckets(self.layout):
            buffer = torch.zeros(bucket.numel, dtype=torch.float32)
            self.sums.update(bucket.views(buffer))
            self._works.append(self.group.reduce([buffer], gloo.reduce_options()))
        self._works.append(self.group.reduce([self.member_norms], gloo.reduce_options()))

    def abandon(self) -> None:
        """Give the reduce up: collectives still in flight are waited out on a thread of their
        own, which then drops the group."""
        pending = [work for work in self._works if not work.is_completed()]
        self.sums = {}
        if not pending:
            return
        # the thread holds the group until its collectives ended: dropping it here would block
        # this thread in its destructor until they do
        group, self.group, self._works = self.group, None, []
        threading.Thread(
            target=_drain, args=(group, pending), name="userdp-group-drain", daemon=True
        ).start()


def _drain(group: dist.ProcessGroupGloo, pending: list) -> None:
    """Wait out an abandoned reduce's collectives, then let ``group`` go."""
    for work in pending:
        try:
            work.wait()
        except Exception:  # expected: a member died or the group timed out
            log.debug("an abandoned reduce's collective failed", exc_info=True)
    del group


class _ReduceWait:
    """The coordinator's loop while a reduce's collectives run: events are handled as in the
    gather; a member's ``TaskFailed`` for the reduce, a lost member or a failed generation ends
    the wait at once (the reduce cannot give the step's sum; collectives still in flight are
    waited out by :meth:`_RootCollectives.abandon`)."""

    def __init__(
        self,
        fleet: Fleet,
        collect: StepGather,
        task_id: str,
        deadline: float,
        current: Callable[[], bool],
    ) -> None:
        self.fleet, self.collect, self.task_id, self.deadline = fleet, collect, task_id, deadline
        self.current = current

    def until(self, done: Callable[[], bool]) -> str:
        """Handle events until ``done()``; returns why the reduce cannot end well ("" = done)."""
        fleet = self.fleet
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
            if not self.current():
                return "the group failed (see above)"
        return ""
