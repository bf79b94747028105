"""The coordinator's side of the collective data plane: :class:`GroupPlane`, the
:class:`~userdp.server.sum_plane.SumPlane` by which the workers' process group reduces the
step's sums and passes each model version on.

With ``coordinator.data_plane = "collective"`` model-size tensors do not pass through the
coordinator once per worker. The coordinator hosts the rendezvous (a torch.distributed TCPStore)
and keeps gRPC as the control plane; the workers of a step form one gloo process group
(:mod:`userdp.clients.group_plane`):

- **Generations.** At the start of a gather the step's workers (live, in sync, able to hold sums)
  become the group's members, sorted by id; member 0 is the *leader*. A generation is two gloo
  groups (:mod:`userdp.proto.gloo`): the reduce group, whose rank 0 is the coordinator, and the
  members' group, which carries the broadcast. A new membership, or a
  failure of the current group seen by the coordinator (a member lost, replaced or rejoined, a
  failed join, reduce or broadcast), starts a new generation under a fresh prefix of the store
  (``GroupJoin``; each member answers ``GroupJoined``). A worker whose join fails
  :data:`MAX_JOIN_FAILURES` times in a row is left out of later generations (it gets no tasks;
  the log says why).
- **Reduce.** Tasks go only to members and say ``hold``: a worker keeps its clipped sum and
  answers with the units and statistics, which the step's
  :class:`~userdp.server.aggregation.StepGather` judges as usual. When every shard group is done,
  each member is told which of its held sums were accepted (``GroupReduce``); the members reduce
  exactly those straight to the coordinator, the root of the generation's reduce group
  (:class:`~userdp.server.group_root.GroupRoot`), each with the norm of its share. The gather
  checks the sum (names, shapes, finite, ‖sum‖ ≤ the bound of every counted unit) and each
  member's share (≤ the bound of the units accepted from it) before it becomes the cohort's sum.
  The coordinator's traffic per step is a fixed number of model sizes, whatever the number of
  workers.
- **Broadcast.** A new version goes over gRPC to the leader only, and through the members' group
  to the other members (``GroupModel``); every member acknowledges it as before. A worker that is not a
  member gets it over gRPC, and a member that could not apply it is resynced, as always.
- **Faults.** A member lost, a member that cannot contribute, a failed collective, a reduce not
  done by the step's deadline (at least twice the group's timeout), or a bad reduced sum aborts
  the step
  (:class:`~userdp.server.fleet.StepAborted`): nothing was noised, charged or released, and the
  retried step forms a new generation and draws fresh noise.

Noise is still added by the coordinator, once, to the reduced sum (docs/privacy.md, "Trust
boundary of the collective data plane").
"""

from __future__ import annotations

import datetime
import logging
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto.layout import TensorLayout
from userdp.server.fleet import StepAborted
from userdp.server.group_root import GroupRoot
from userdp.server.registry import (
    Event,
    GroupJoinedEvent,
    ModelAcked,
    WorkerJoined,
    WorkerLost,
    WorkerSession,
)
from userdp.server.sum_plane import SumArrival

if TYPE_CHECKING:  # types only: the fleet is given its plane
    from userdp.server.aggregation import StepGather
    from userdp.server.coordinator import CoordinatorSettings
    from userdp.server.fleet import Fleet

log = logging.getLogger("userdp.server.coordinator")

MAX_JOIN_FAILURES = 2
"""Failed joins in a row after which a worker is left out of the group (and so gets no tasks)."""


@dataclass(frozen=True)
class GroupSettings:
    """The collective data plane's settings (``coordinator.group_*``)."""

    store_port: int = 0
    """The TCPStore's port (0 = a free one, for ``simulate``)."""
    store_host: str = ""
    """The host workers dial for the store ("" = the host they reach the coordinator at)."""
    timeout_s: float = 300.0
    """Every collective of the group fails after this long (a member died)."""
    store_bind: str = "0.0.0.0"  # noqa: S104 - the store serves workers on other hosts
    """The address the store listens on."""


class GroupPlane:
    """The workers' process group as the coordinator sees it (see the module docstring): its
    generations, and the answers of the collective data plane to a fleet
    (:class:`~userdp.server.sum_plane.SumPlane`)."""

    arrival = SumArrival.REDUCED

    def __init__(self, settings: GroupSettings) -> None:
        self.settings = settings
        self.store = dist.TCPStore(
            settings.store_bind,
            settings.store_port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=settings.timeout_s),
        )
        self.port = self.store.port
        self._nonce = secrets.token_hex(8)  # a restarted coordinator never reuses a prefix
        # generations of a restarted coordinator never collide with the last one's either
        self.generation = secrets.randbelow(1 << 40)
        self.members: tuple[str, ...] = ()
        self.sessions: dict[str, str] = {}
        """Member → the session id it was asked to join from (a replaced session breaks it)."""
        self.healthy = False
        self.root: GroupRoot | None = None
        """The coordinator's rank in the current generation's reduce group, and its reduces."""
        self.join_failures: dict[str, int] = {}
        self.excluded: set[str] = set()
        self.reduces = 0
        """Reduces started (each has its own task id)."""
        self.reduce_seconds = 0.0
        """The last reduce that ended well: from the members' ``GroupReduce`` to the checked
        reduced sum (the sum of its :attr:`reduce_phases`)."""
        self.reduce_phases: dict[str, float] = {}
        """The last reduce's parts (:attr:`GroupRoot.phases
        <userdp.server.group_root.GroupRoot.phases>`)."""

    def _store_host(self) -> str:
        """Where the coordinator itself reaches its store."""
        bind = self.settings.store_bind
        return "127.0.0.1" if bind in ("0.0.0.0", "", "::") else bind  # noqa: S104

    @property
    def leader(self) -> str | None:
        return self.members[0] if self.members else None

    def _candidates(self, sessions: Mapping[str, Any]) -> dict[str, Any]:
        """The sessions that may be members: they can hold sums and were not left out."""
        return {
            w: s
            for w, s in sessions.items()
            if s.capabilities.collective_plane and w not in self.excluded
        }

    def _form(self, sessions: Mapping[str, Any], rendezvous_s: float) -> None:
        """Make ``sessions`` (worker id → session) the members, starting a new generation when
        they differ from the current ones or the current generation failed; the coordinator
        waits up to ``rendezvous_s`` for the members to join its reduce group."""
        members = tuple(sorted(sessions))
        ids = {w: sessions[w].session_id for w in members}
        if self.healthy and members == self.members and ids == self.sessions:
            return
        self.generation += 1
        self.members, self.sessions = members, ids
        self.healthy = bool(members)
        prefix = f"userdp/{self._nonce}/{self.generation}/"
        timeout_s = self.settings.timeout_s
        if self.root is not None:
            self.root.cancel()
        self.root = (
            GroupRoot(
                (self._store_host(), self.port),
                prefix,
                members,
                timeout_s,
                rendezvous_s,
                self.generation,
            )
            if members
            else None
        )
        for rank, worker in enumerate(members):
            join = pb.GroupJoin(
                generation=self.generation,
                rank=rank,
                world_size=len(members),
                store_host=self.settings.store_host,
                store_port=self.port,
                store_prefix=prefix,
                backend="gloo",
                timeout_s=timeout_s,
                coordinator_root=True,
            )
            sessions[worker].send(pb.CoordinatorMessage(group_join=join))
        if members:
            log.info(
                "workers' group generation %d: %d member(s), leader %s",
                self.generation,
                len(members),
                members[0],
            )

    def _joined(self, worker: str, generation: int, ok: bool, error: str) -> None:
        """A member's ``GroupJoined``: a failed join breaks the generation; repeated failures
        leave the worker out of later ones."""
        if generation != self.generation or worker not in self.members:
            return
        if ok:
            self.join_failures.pop(worker, None)
            return
        if not self.healthy:
            return  # the generation already failed: later failures are its consequences
        # the first member to report a failed join is counted (the others then time out
        # waiting for it)
        self.join_failures[worker] = self.join_failures.get(worker, 0) + 1
        self._broken(f"{worker} could not join: {error}")
        if self.join_failures[worker] >= MAX_JOIN_FAILURES:
            self.excluded.add(worker)
            log.error(
                "worker %s failed to join the workers' group %d times (%s); it gets no more "
                "tasks under the collective data plane: check that the workers reach each other "
                "and the coordinator's group port, and GLOO_SOCKET_IFNAME",
                worker,
                MAX_JOIN_FAILURES,
                error,
            )

    def _broken(self, reason: str) -> None:
        """The current generation cannot be used again: the next gather forms a new one."""
        if self.healthy:
            log.warning("workers' group generation %d failed: %s", self.generation, reason)
        self.healthy = False

    def _model_messages(self, version: int, metas: list) -> dict[str, pb.CoordinatorMessage]:
        """Worker → its ``GroupModel`` for ``version`` (the leader is the source)."""
        return {
            worker: pb.CoordinatorMessage(
                group_model=pb.GroupModel(
                    model_version=version,
                    generation=self.generation,
                    source=rank == 0,
                    tensors=metas,
                )
            )
            for rank, worker in enumerate(self.members)
        }

    # ---- a fleet's questions (userdp.server.sum_plane.SumPlane) ---------------------------------

    def ack_wait_s(self, settings: CoordinatorSettings) -> float:
        """A version takes two hops (to the leader, through the group): members still receiving
        it when the step starts would change the membership."""
        return max(settings.ack_wait_s, self.settings.timeout_s)

    def start_gather(
        self, eligible: Mapping[str, WorkerSession], settings: CoordinatorSettings
    ) -> None:
        """The eligible workers that can hold sums become the members (a new generation when
        they changed or the current one failed)."""
        self._form(self._candidates(eligible), self._rendezvous_s(settings))

    def _rendezvous_s(self, settings: CoordinatorSettings) -> float:
        """How long the coordinator waits for the members to join its reduce group: as long as
        it would wait for the step's reduce."""
        return settings.step_deadline_s + 2 * self.settings.timeout_s

    def task_workers(self, eligible: Mapping[str, WorkerSession]) -> dict[str, WorkerSession]:
        """Only the group's members can join its reduce."""
        return {w: s for w, s in eligible.items() if w in self.members}

    def complete_gather(self, fleet: Fleet, collect: StepGather, deadline: float) -> None:
        """The members reduce their accepted held sums straight to the coordinator
        (:meth:`GroupRoot.reduce <userdp.server.group_root.GroupRoot.reduce>`) with each
        member's norm; the sum, checked as a whole and member by member, completes ``collect``.
        :class:`~userdp.server.fleet.StepAborted` (and a broken generation) when a member
        holding sums is lost, a member cannot contribute, a collective fails, or the sum is bad
        or late. Members lost before the reduce that hold none are left out by a new
        generation."""
        held = collect.held_by()
        if not self.healthy:
            raise StepAborted(f"step {collect.step}: the workers' group failed before the reduce")
        sessions = self._member_sessions(fleet)
        live = {w: s for w, s in sessions.items() if s is not None and s.alive}
        lost = [w for w in self.members if w not in live]
        if any(held.get(w) for w in lost):
            self._broken(f"member(s) {lost} lost before the reduce")
            raise StepAborted(f"step {collect.step}: group member(s) {lost} lost before the reduce")
        if lost:
            self._broken(f"member(s) {lost} lost; they held no sums of step {collect.step}")
            self._form(live, self._rendezvous_s(fleet.settings))
        if not self.members:  # an empty cohort and no worker: nothing to reduce
            zeros = {n: torch.zeros(t.shape) for n, t in collect.template_tensors().items()}
            problem = collect.offer_reduced(zeros, {})
            if problem is None:
                return
            raise StepAborted(f"step {collect.step}: {problem}")
        self.reduces += 1
        root, generation = self.root, self.generation
        problem = root.reduce(
            fleet,
            collect,
            live,
            f"{collect.step}.reduce.{self.reduces}",
            deadline,
            current=lambda: self.healthy and self.generation == generation,
        )
        self.reduce_phases = root.phases
        if not problem:
            self.reduce_seconds = sum(root.phases.values())
            return
        self._broken(problem)
        raise StepAborted(f"step {collect.step}: the workers' reduce failed: {problem}")

    def _member_sessions(self, fleet: Fleet) -> dict[str, WorkerSession | None]:
        """The current sessions of the group's members (None: gone; a session other than the
        one asked to join counts as gone)."""
        out: dict[str, WorkerSession | None] = {}
        for worker in self.members:
            session = fleet.registry.get(worker)
            out[worker] = (
                session
                if session is not None and session.session_id == self.sessions.get(worker)
                else None
            )
        return out

    def observe(self, event: Event) -> None:
        """What an event means for the workers' group: a failed join, a member lost, replaced
        or rejoined, or a member that could not apply a version break the generation."""
        worker = event.session.worker_id
        if worker not in self.members:
            return
        if isinstance(event, GroupJoinedEvent):
            self._joined(worker, event.generation, event.ok, event.error)
        elif isinstance(event, WorkerLost | WorkerJoined):
            self._broken(
                f"member {worker} {'lost' if isinstance(event, WorkerLost) else 'rejoined'}"
            )
        elif isinstance(event, ModelAcked) and event.rejected:
            self._broken(f"member {worker} could not apply a model version")

    def broadcast(
        self, fleet: Fleet, targets: Sequence[WorkerSession], trainable: Mapping[str, object]
    ) -> list[WorkerSession]:
        """Announce the fleet's version to the group's members when the group can carry it
        (healthy, every member live, the leader a target): the fleet then streams it to the
        leader and to the targets that are no members; otherwise to every target."""
        if not self.healthy:
            return list(targets)
        sessions = self._member_sessions(fleet)
        if any(s is None or not s.alive for s in sessions.values()) or self.leader not in {
            s.worker_id for s in targets
        }:
            self._broken("a member is lost or the leader missed the last version")
            return list(targets)
        version = fleet.model_version
        messages = self._model_messages(version, TensorLayout.of_tensors(trainable).metas())
        for worker, message in messages.items():
            sessions[worker].send(message)
            sessions[worker].sent_version = version
        return [s for s in targets if s.worker_id not in self.members or s.worker_id == self.leader]
