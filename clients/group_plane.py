"""A worker's part in the collective data plane: the workers' process group, its reduce and its
model broadcast.

Under the collective data plane (``coordinator.data_plane = "collective"``, docs/protocol.md) the
coordinator forms a process group of the step's workers: one torch.distributed gloo group per
membership (a *generation*), rendezvousing in the coordinator's key-value store (a TCPStore).
Its groups are :class:`torch.distributed.ProcessGroupGloo` of their own, apart from the default
process group, which a multi-rank worker keeps for its own ranks (only rank 0, the rank that
talks to the coordinator, joins them).

:class:`WorkerGroup` runs the group's operations on one thread, in the order the coordinator's
stream delivered them, so every member issues the same collectives in the same order:

- ``GroupJoin``: build the generation's two groups (:mod:`userdp.proto.gloo`: the reduce group,
  whose rank 0 is the coordinator, then the members' group; the previous generation's are
  dropped) and answer ``GroupJoined`` (joined, or why not).
- ``GroupReduce``: the members and the coordinator first all-reduce a failure count (a member
  whose named held sum is missing says so), so either all reduce or none does and the
  coordinator never takes a sum that lacks units. Then each member adds up the held task sums
  the coordinator accepted, bucket by bucket (float32), and reduces each bucket to the
  coordinator; last, a vector with the norm of its own sum in its rank's slot (zeros
  elsewhere), so the coordinator learns every member's norm and checks each against the
  bound of the units it accepted from that member. A member that cannot contribute, or whose collective fails, reports
  ``TaskFailed`` for the reduce; a member that contributed sends nothing (the coordinator holds
  the sum when its own reduce completes).
- ``GroupModel``: the leader (rank 0 of the members' group, the *source*) receives a model
  version over gRPC and broadcasts its raw bytes; the others receive them and apply them as if
  they had arrived over gRPC, then acknowledge. A header broadcast first says which version the
  source has, whether it has it and how many bytes follow, so a source that could not apply it
  never makes the others apply garbage, and every member consumes exactly the bytes the source
  sends. (A source without a working group sends nothing: the others' receive fails at the
  group's timeout.)

A collective that does not complete (a member died) fails after the group's timeout; the
coordinator then aborts the step and forms a new generation.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from userdp.clients.task_runner import task_failed
from userdp.proto import gloo
from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto.collectives import broadcast_bytes, failure_count
from userdp.proto.layout import TensorLayout
from userdp.proto.tensors import WireTensor

log = logging.getLogger(__name__)

Outbox = Callable[[pb.WorkerMessage], None]


class WorkerGroup:
    """This worker's membership in the workers' process group (see the module docstring)."""

    def __init__(
        self, runner: Any, default_host: str, on_version: Callable[[int], None] | None = None
    ) -> None:
        """``on_version(v)``: called after a version received through the group was applied."""
        self.runner = runner
        self.default_host = default_host
        self.on_version = on_version
        self.generation = -1
        self.rank = -1
        self.world_size = 0
        self._group: dist.ProcessGroupGloo | None = None
        """The members' group (the version broadcast)."""
        self._reducer: dist.ProcessGroupGloo | None = None
        """The reduce group (the coordinator is its rank 0)."""
        self._error = "no group joined"
        self._sources: dict[int, pb.GroupModel] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._ops: queue.Queue = queue.Queue()
        self._thread = threading.Thread(
            target=self._loop, name=f"userdp-group-{runner.worker_id}", daemon=True
        )
        self._thread.start()

    # ---- called from the stream's thread --------------------------------------------------------

    def join(self, message: pb.GroupJoin, send: Outbox) -> None:
        self._ops.put((self._join, (message, send)))

    def reduce(self, message: pb.GroupReduce, send: Outbox) -> None:
        self._ops.put((self._reduce, (message, send)))

    def model(self, message: pb.GroupModel, send: Outbox) -> None:
        """A version travels through the group: the source waits for its gRPC commit
        (:meth:`source_applied`), the others receive it now."""
        if message.source:
            with self._lock:
                self._sources[message.model_version] = message
        else:
            self._ops.put((self._receive, (message, send)))

    def source_applied(self, version: int, tensors: Mapping[str, WireTensor] | None) -> None:
        """The source received ``version`` over gRPC (``tensors`` None: it could not apply it);
        broadcast it when the coordinator said so."""
        with self._lock:
            message = self._sources.pop(version, None)
        if message is not None:
            self._ops.put((self._broadcast, (message, tensors)))

    def forget_sources(self) -> None:
        """A new coordinator: the versions the last one said to broadcast are void."""
        with self._lock:
            self._sources.clear()

    def close(self, wait_s: float = 0.0) -> None:
        """Stop the group's thread, which drops the groups; wait up to ``wait_s`` for it. A
        process about to exit waits: one that exits while its group's thread is inside gloo
        (a join or a collective with a peer that just died) aborts at exit."""
        self._closed.set()
        self._ops.put(None)
        if wait_s > 0 and threading.current_thread() is not self._thread:
            self._thread.join(wait_s)

    # ---- the group's thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            op = self._ops.get()
            if op is None:
                self._group = self._reducer = None
                return
            fn, args = op
            try:
                fn(*args)
            except Exception:  # the coordinator learns of it through the reduce or the ack
                log.exception("worker %s: group operation failed", self.runner.worker_id)

    def _join(self, message: pb.GroupJoin, send: Outbox) -> None:
        # the previous generation's groups, dropped before the rendezvous
        self._group = self._reducer = None
        self.generation, self.rank = message.generation, message.rank
        self.world_size = message.world_size
        host = message.store_host or self.default_host
        try:
            if not message.coordinator_root:
                raise ValueError("the coordinator does not take part in the reduce (an older one)")
            store = gloo.client_store(host, message.store_port, message.timeout_s)
            prefix, size, timeout_s = message.store_prefix, message.world_size, message.timeout_s
            # every rank builds its part of a group only once all have arrived (a wait this
            # thread can leave); the coordinator builds only the reduce group, so every member
            # builds it first
            # (the device first: a worker that cannot open its interface fails at once)
            transport = gloo.device()
            gloo.arrive(store, prefix, message.rank + 1)
            gloo.wait_arrived(store, prefix, list(range(size + 1)), timeout_s, self._closed.is_set)
            self._reducer = gloo.group(
                store, prefix + gloo.REDUCE_PREFIX, message.rank + 1, size + 1, timeout_s, transport
            )
            self._group = gloo.group(
                store, prefix + gloo.MEMBERS_PREFIX, message.rank, size, timeout_s, transport
            )
            self._error = ""
            send(
                pb.WorkerMessage(
                    group_joined=pb.GroupJoined(generation=message.generation, ok=True)
                )
            )
            log.info(
                "worker %s: rank %d of %d in group generation %d",
                self.runner.worker_id,
                message.rank,
                message.world_size,
                message.generation,
            )
        except Exception as exc:
            self._group = self._reducer = None
            self._error = f"joining group generation {message.generation}: {exc}"
            log.warning("worker %s: %s", self.runner.worker_id, self._error)
            joined = pb.GroupJoined(generation=message.generation, ok=False, error=self._error)
            send(pb.WorkerMessage(group_joined=joined))

    def _usable(self, generation: int) -> str:
        """Why this worker cannot take part in a collective of ``generation`` ("" = it can)."""
        if generation != self.generation:
            return f"group generation {generation} was not joined (holding {self.generation})"
        return self._error if self._group is None or self._reducer is None else ""

    def _reduce(self, message: pb.GroupReduce, send: Outbox) -> None:
        task = pb.Task(
            task_id=message.task_id,
            attempt=message.attempt,
            step=message.step,
            model_version=message.model_version,
        )
        problem = self._usable(message.generation)
        if problem:
            send(task_failed(task, problem))
            return
        held, missing = self._held_sums(message)
        if missing:
            log.warning("worker %s: %s", self.runner.worker_id, missing)
            send(task_failed(task, missing))
        try:
            # every rank learns first whether all members can contribute, so none starts the
            # data reduce alone and the coordinator never takes a sum that lacks units
            if failure_count(bool(missing), self._reducer):
                return
            # each bucket's reduce runs while the next bucket is filled (two buckets in memory)
            pending, squared = None, 0.0
            for bucket in gloo.buckets(TensorLayout.of_metas(message.tensors)):
                buffer = _in_place(held[0], bucket) if held else None
                if buffer is not None:  # the first held sum is the buffer: add the others
                    self._fill(buffer, bucket, held[1:], written=True)
                else:
                    buffer = torch.empty(bucket.numel, dtype=torch.float32)
                    self._fill(buffer, bucket, held, written=False)
                # this member's share, measured before the reduce may overwrite the buffer
                squared += float(buffer.square().sum(dtype=torch.float64))
                work = self._reducer.reduce([buffer], gloo.reduce_options())
                if pending is not None:
                    pending.wait()
                pending = work
            if pending is not None:
                pending.wait()
            # ‖this member's sum‖ in its own slot: the coordinator checks every member's share
            # against the bound of the units it accepted from it
            norms = torch.zeros(self.world_size, dtype=torch.float64)
            norms[self.rank] = math.sqrt(squared)
            self._reducer.reduce([norms], gloo.reduce_options()).wait()
        except Exception as exc:  # the coordinator's own reduce fails too
            self._group = self._reducer = None
            self._error = f"reduce of step {message.step} failed: {exc}"
            log.warning("worker %s: %s", self.runner.worker_id, self._error)
            send(task_failed(task, self._error))

    def _held_sums(self, message: pb.GroupReduce) -> tuple[list[Mapping], str]:
        """The held sums ``message`` names, and what is wrong with them ("" = nothing)."""
        held = self.runner.take_held(message.step, message.gather, list(message.held))
        if held is None:
            return [], f"step {message.step}: a held sum of {list(message.held)} is missing"
        layout = TensorLayout.of_metas(message.tensors)
        for sums in held:
            for name, size in zip(layout.names, layout.sizes, strict=True):
                value = sums.get(name)
                if value is None or value.numel() != size:
                    return [], f"step {message.step}: a held sum lacks tensor {name!r}"
        return held, ""

    def _fill(
        self, buffer: torch.Tensor, bucket: TensorLayout, held: list[Mapping], written: bool
    ) -> None:
        """``buffer`` (+)= Σ over ``held`` of the bucket's tensors, laid out as ``bucket``
        (``written``: the buffer already holds a sum to add to)."""
        for name, view in bucket.views(buffer).items():
            if not held and not written:
                view.zero_()
            for i, sums in enumerate(held):
                value = sums[name].reshape(view.shape)
                view.copy_(value) if i == 0 and not written else view.add_(value)

    def _broadcast(self, message: pb.GroupModel, tensors: Mapping[str, WireTensor] | None) -> None:
        if self._usable(message.generation):
            return  # the members fail their receive at the timeout and are resynced
        try:
            ok = tensors is not None and all(m.name in tensors for m in message.tensors)
            parts = (
                [np.frombuffer(tensors[m.name].data, np.uint8) for m in message.tensors]
                if ok
                else []
            )
            data = torch.from_numpy(np.concatenate(parts)) if ok else None
            # the header says which version the source has and whether it has it
            broadcast_bytes(data, group=self._group, header=(message.model_version, int(ok)))
        except Exception as exc:
            self._group, self._error = None, f"broadcast of version {message.model_version}: {exc}"
            log.warning("worker %s: %s", self.runner.worker_id, self._error)

    def _receive(self, message: pb.GroupModel, send: Outbox) -> None:
        version, tensors = message.model_version, None
        problem = self._usable(message.generation)
        if not problem:
            try:
                # every byte the source sends is taken, whatever it is
                (sent, ok), data = broadcast_bytes(None, group=self._group, header=(version, 0))
                if sent != version or not ok:
                    problem = f"the group's source did not have version {version}"
                else:
                    tensors = TensorLayout.of_metas(message.tensors).split_bytes(data.numpy())
            except Exception as exc:
                self._group, self._error = None, f"receiving version {version}: {exc}"
                problem = self._error
        applied = tensors is not None and self.runner.apply_tensors(tensors, False, version)
        if problem:
            log.warning("worker %s: %s", self.runner.worker_id, problem)
        ack = pb.ModelAck(model_version=self.runner.model_version, rejected=not applied)
        send(pb.WorkerMessage(model_ack=ack))
        if applied and self.on_version is not None:
            self.on_version(version)


def _in_place(sums: Mapping, bucket: TensorLayout) -> torch.Tensor | None:
    """The bucket as one flat float32 view of ``sums``' own memory when its tensors lie there
    back to back in the bucket's order, as the engines' accumulator lays out a task's sums (one
    host buffer, a view per parameter); else None. A held sum is reduced once and then dropped,
    so the reduce may overwrite it: no copy of the model-size sum is made."""
    first = sums[bucket.names[0]]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for name, size in zip(bucket.names, bucket.sizes, strict=True):
        value = sums[name]
        if (
            value.dtype != torch.float32
            or value.device.type != "cpu"
            or not value.is_contiguous()
            or value.untyped_storage().data_ptr() != storage
            or value.storage_offset() != offset
        ):
            return None
        offset += size
    return torch.as_strided(first, (bucket.numel,), (1,), first.storage_offset())
