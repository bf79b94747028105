"""A worker's model versions and tasks, apart from the connection that carries them.

:class:`TaskRunner` holds the model version a worker computes on and its :class:`TaskCompute`;
:class:`~userdp.clients.grpc_client.WorkerClient` extends it with the connection (connect,
reconnect, heartbeat, drain) and feeds it what the stream carries.

Model versions: :class:`ModelReceiver` collects one version's chunks. A full ``ModelCommit``
replaces every tensor; a non-full one (a step's update) is applied only on top of the version
just before it. Tensors that do not reassemble, or a full model whose sha256 does not match the
commit, are not applied: the worker keeps its model and acknowledges the version it really has,
so the coordinator resyncs it instead of trusting it.

Tasks: a task for a model version other than the worker's is refused (``TaskFailed``), never
computed on the wrong model; a compute error is a ``TaskFailed`` too; a cancelled task is dropped
before and after its compute. The clipped sum goes out as ``ResultPart`` chunks and the
``Result`` that closes them (:mod:`userdp.proto.codec`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from typing import Protocol

from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto.codec import result_parts, result_proto
from userdp.proto.results import TaskSum
from userdp.proto.tensors import TensorAssembler, TensorDecodeError, WireTensor, tensors_sha256

log = logging.getLogger(__name__)


class TaskCompute(Protocol):
    """What a worker computes with: holds the model, applies versions, sums clipped units."""

    def apply_model(self, tensors: Mapping[str, WireTensor], full: bool) -> None: ...

    def compute(self, task: pb.Task) -> TaskSum: ...


class ModelReceiver:
    """Collects one model version's chunks."""

    def __init__(self) -> None:
        self.assembler = TensorAssembler()
        self.version: int | None = None
        self.error: str | None = None

    def add(self, part: pb.ModelPart) -> None:
        if self.error:
            return
        if self.version is None:
            self.version = part.model_version
        elif part.model_version != self.version:
            self.error = f"model parts of versions {self.version} and {part.model_version} mixed"
            return
        try:
            self.assembler.add(part.chunk)
        except TensorDecodeError as exc:
            self.error = str(exc)

    def finish(self, commit: pb.ModelCommit) -> dict[str, WireTensor]:
        if self.error:
            raise TensorDecodeError(self.error)
        if self.version is not None and self.version != commit.model_version:
            raise TensorDecodeError(
                f"parts of version {self.version}, commit {commit.model_version}"
            )
        tensors = self.assembler.finish(expected_count=commit.num_tensors)
        if commit.params_sha256 and tensors_sha256(tensors) != commit.params_sha256:
            raise TensorDecodeError(f"model version {commit.model_version}: sha256 mismatch")
        return tensors


class TaskRunner:
    """A worker's model version and task execution (see the module docstring).

    ``session_chunk_bytes``: the largest result chunk (the connection sets it per session)."""

    def __init__(self, worker_id: str, compute: TaskCompute, session_chunk_bytes: int) -> None:
        self.worker_id = worker_id
        self.compute = compute
        self.session_chunk_bytes = session_chunk_bytes
        self.model_version = -1
        self.tasks_done = 0
        self._model_lock = threading.Lock()
        self._held: dict[str, tuple[tuple[int, int], Mapping]] = {}
        """"task_id/attempt" → ((step, gather), the held sums)."""
        self._held_lock = threading.Lock()

    def _receive_version(
        self, model: ModelReceiver, commit: pb.ModelCommit
    ) -> Mapping[str, WireTensor] | None:
        """Apply a model version if it is consistent: its tensors when it was, else None."""
        try:
            tensors = model.finish(commit)
        except TensorDecodeError as exc:
            log.warning(
                "worker %s: bad model version %d: %s", self.worker_id, commit.model_version, exc
            )
            return None
        return tensors if self.apply_tensors(tensors, commit.full, commit.model_version) else None

    def apply_tensors(self, tensors: Mapping[str, WireTensor], full: bool, version: int) -> bool:
        """Apply ``version`` (an update only on top of the version before it); whether it was."""
        with self._model_lock:
            if not full and self.model_version != version - 1:
                log.info(
                    "worker %s: update %d does not follow held version %d; waiting for a resync",
                    self.worker_id,
                    version,
                    self.model_version,
                )
                return False
            self.compute.apply_model(tensors, full)
            self.model_version = version
        return True

    def _hold(self, task: pb.Task, task_sum: TaskSum) -> None:
        """Keep a task's sum for the group's reduce (the collective data plane); sums of earlier
        steps are dropped: a step's reduce comes before the next step's tasks."""
        with self._held_lock:
            for key in [k for k, ((step, _), _) in self._held.items() if step < task.step]:
                del self._held[key]
            self._held[f"{task.task_id}/{task.attempt}"] = ((task.step, task.gather), task_sum.sums)

    def take_held(self, step: int, gather: int, keys: list[str]) -> list[Mapping] | None:
        """Remove and return the held sums ``keys`` of gather ``gather`` of ``step``; None when
        one is missing. Every other sum held for that gather or an earlier one is dropped: a
        reduce names all the sums the coordinator accepted in its gather, so the rest (late
        results, aborted gathers) will never be reduced. Sums of a LATER gather of the step are
        kept: a reduce the coordinator gave up may reach this worker after the retried gather's
        tasks did."""
        with self._held_lock:
            found = [self._held.get(key) for key in keys]
            for key in [k for k, (when, _) in self._held.items() if when <= (step, gather)]:
                del self._held[key]
        if any(entry is None or entry[0] != (step, gather) for entry in found):
            return None
        return [sums for _, sums in found]

    def _task_loop(self, tasks: queue.Queue, outbox: queue.Queue, cancelled: set) -> None:
        """Run the tasks of ``tasks`` until a None arrives, putting the worker's messages on
        ``outbox``; ``cancelled`` holds the (task id, attempt) pairs the coordinator cancelled."""
        while True:
            task = tasks.get()
            if task is None:
                return
            if (task.task_id, task.attempt) in cancelled:
                continue
            started = time.perf_counter()
            with self._model_lock:
                if task.model_version != self.model_version:
                    reason = (
                        f"stale model: task wants {task.model_version}, have {self.model_version}"
                    )
                    outbox.put(task_failed(task, reason))
                    continue
                try:
                    task_sum = self.compute.compute(task)
                except Exception as exc:  # report, never hang the coordinator's step
                    log.exception("worker %s: task %s failed", self.worker_id, task.task_id)
                    outbox.put(task_failed(task, f"{type(exc).__name__}: {exc}"))
                    continue
            if (task.task_id, task.attempt) in cancelled:
                continue
            if task.hold:
                self._hold(task, task_sum)
            else:
                for message in result_parts(task, task_sum.sums, self.session_chunk_bytes):
                    outbox.put(message)
            seconds = time.perf_counter() - started
            result = result_proto(task, task_sum, seconds, held=task.hold)
            outbox.put(pb.WorkerMessage(result=result))
            self.tasks_done += 1


def task_failed(task: pb.Task, reason: str) -> pb.WorkerMessage:
    """The ``TaskFailed`` message for ``task``."""
    return pb.WorkerMessage(
        task_failed=pb.TaskFailed(task_id=task.task_id, attempt=task.attempt, reason=reason)
    )
