"""The coordinator as the root of the workers' reduce (the collective data plane,
:mod:`userdp.server.group_plane`).

Each generation of the workers' group has a *reduce group* (:mod:`userdp.proto.gloo`) whose
rank 0 is the coordinator: the members reduce their accepted held sums straight into the
coordinator's buffers, so the sum reaches it as raw float32 bytes, with no gRPC stream, no
protobuf copy and no worker that must send it alone.

- :class:`ReduceRoot` builds the coordinator's rank of one generation on a thread of its own,
  over a store connection of its own, while the coordinator's loop goes on handling events. It
  first waits, polling the store, until every member said it arrived
  (:data:`userdp.proto.gloo.ARRIVED_PREFIX`), as long as the coordinator would wait for the
  step's reduce (a member may first have to finish what an earlier generation asked of it, each
  part bounded by the group's timeout); the wait ends early when the generation is replaced or
  the process is exiting (a rendezvous blocked inside gloo cannot be left, and would abort the
  process at exit). Then it builds its rank, with the members already waiting; its collectives
  fail after the group's timeout, as the members' do.
- :class:`RootReduce` is one reduce at the root: the failure count all-reduced with the members,
  then one gloo reduce per bucket into the sum's own tensors, then one of the members' norms
  (each member's norm in its rank's slot), which the gather checks member by member. Every collective is issued
  asynchronously; the coordinator polls them between events, so a member lost or a failure
  reported meanwhile is seen at once. A reduce given up while collectives are still in flight is
  handed to a thread that waits them out (each ends by the group's timeout at the latest), so the
  coordinator never blocks on a dead member.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist
from userdp.proto import gloo
from userdp.proto.collectives import start_failure_count
from userdp.proto.layout import TensorLayout

log = logging.getLogger("userdp.server.coordinator")


class ReduceRoot:
    """The coordinator's rank 0 in one generation's reduce group (see the module docstring)."""

    def __init__(
        self,
        address: tuple[str, int],
        prefix: str,
        members: int,
        timeout_s: float,
        rendezvous_s: float,
        generation: int,
    ) -> None:
        self.group: dist.ProcessGroupGloo | None = None
        self.error = ""
        self._ready = threading.Event()
        self._cancelled = threading.Event()
        threading.Thread(
            target=self._join,
            args=(address, prefix, members + 1, timeout_s, rendezvous_s),
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


class RootReduce:
    """One reduce at the root (see the module docstring): :meth:`completed` says when the
    collectives issued so far have ended, :meth:`problem` whether one failed."""

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
